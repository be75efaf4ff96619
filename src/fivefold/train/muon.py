"""Muon (torch.optim.Muon's definition in PyTorch 2.13) over the tensors a layout hands the
optimizer: whole matrices, stacked expert matrices, or ZeRO chunks cutting through matrices.

Per tensor: momentum (elementwise, so a chunk gets exactly what the whole would: buf ← lerp(buf,
g, 1−μ), Nesterov update = lerp(g, buf, μ)), then each matrix's update orthogonalised whole by
torch's own Newton–Schulz (`torch.optim._muon._zeropower_via_newtonschulz`, 5 steps, its
coefficients, in bf16), then decoupled weight decay and the step lr·AdjustLR(shape) (torch's
`_adjust_lr`). Why not torch.optim.Muon itself: it takes whole 2-D tensors only, while experts
are stacked 3-D tensors (each expert's matrix orthogonalised on its own) and ZeRO-1/2 hand the
optimizer flat chunks whose matrices must be gathered first. So this class keeps torch's
momentum and lr arithmetic line for line and calls torch's functions for the rest; a test holds it
to torch.optim.Muon within 1e-6 (tests/test_muon.py).

Where the whole matrices are is the layout's business (`layout`, parallel/data/muon_step.py):
`matrices(tensor)` lists (start, end, shape) of the matrices inside the flat tensor, and
`orthogonalize(tensor, update)` returns the flat orthogonalised update (a collective where the
matrices are sharded). Without a layout each tensor holds whole matrices.
"""

from __future__ import annotations

import math

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _adjust_lr

NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)


def whole_matrices(shape: tuple[int, ...]) -> list[tuple[int, int, tuple[int, int]]]:
    """(start, end, shape) of each matrix of a row-major tensor: itself if 2-D, each [i] of a
    stack of matrices (experts: [n_experts, rows, cols])."""
    rows, cols = shape[-2:]
    size = rows * cols
    return [(i * size, (i + 1) * size, (rows, cols)) for i in range(math.prod(shape[:-2]))]


def newton_schulz(update: torch.Tensor) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of one 2-D matrix (its own function, its defaults)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(update, NS_COEFFICIENTS, DEFAULT_NS_STEPS, EPS)


class WholeTensors:
    """Every tensor holds whole matrices on this rank: orthogonalise each here."""

    def matrices(self, tensor: torch.Tensor):
        return whole_matrices(tuple(tensor.shape))

    def orthogonalize(self, tensor: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        flat, out = update.reshape(-1), torch.empty(update.numel(), dtype=update.dtype, device=update.device)
        for start, end, shape in self.matrices(tensor):
            out[start:end] = newton_schulz(flat[start:end].view(shape)).reshape(-1)
        return out


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr: float, momentum: float = 0.95, weight_decay: float = 0.1,
                 nesterov: bool = True, adjust_lr_fn: str = "original", layout=None):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                                  "nesterov": nesterov, "adjust_lr_fn": adjust_lr_fn})
        self.layout = layout or WholeTensors()
        for group in self.param_groups:
            for param in group["params"]:
                if param.dim() < 2 and not getattr(self.layout, "flat", False):
                    raise ValueError(f"Muon updates matrices; got a tensor of shape {tuple(param.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
            # Every rank visits the same tensors in the same order: a sharded layout's
            # orthogonalisation is a collective.
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad, state = param.grad, self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                orthogonal = self.layout.orthogonalize(param, update)
                param.mul_(1 - lr * decay)
                flat = param.view(-1)
                for start, end, shape in self.layout.matrices(param):
                    flat[start:end].add_(orthogonal[start:end], alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape))
        return None
