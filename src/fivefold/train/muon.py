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

Where the whole matrices are is the layout's business (`layout`: parallel/data/muon_step.py for
ZeRO's chunks, parallel/muon_dtensor.py for tensor-parallel and FSDP2 shards):
`matrices(tensor)` lists (start, end, shape) of the matrices inside this rank's flat piece of the
tensor, with their whole shapes, and `orthogonalize(tensors, updates)` returns, for a window of
`window` tensors, this rank's flat piece of each orthogonalised update (collectives where the
matrices are sharded). Without a layout each tensor holds whole matrices (parallel/muon_matrices.py).
"""

from __future__ import annotations

import torch
from torch.optim._muon import _adjust_lr

from fivefold.parallel.grad_norm import local_tensor
from fivefold.parallel.muon_matrices import WholeTensors


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr: float, momentum: float = 0.95, weight_decay: float = 0.1,
                 nesterov: bool = True, adjust_lr_fn: str = "original", layout=None, ns_dtype: str = "bf16"):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                                  "nesterov": nesterov, "adjust_lr_fn": adjust_lr_fn})
        self.layout = layout or WholeTensors()
        # Not a group setting: a checkpoint's groups would carry it back over the configured one.
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            for param in group["params"]:
                if param.dim() < 2 and not getattr(self.layout, "flat", False):
                    raise ValueError(f"Muon updates matrices; got a tensor of shape {tuple(param.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            # Every rank visits the same tensors in the same order: a sharded layout's
            # orthogonalisation is a collective. The layout takes a window of tensors at once
            # (`window`: as many as a group has ranks), so that their owners orthogonalise at the
            # same time instead of each waiting for the one before.
            params = [param for param in group["params"] if param.grad is not None]
            size = self.layout.window
            for first in range(0, len(params), size):
                window = params[first:first + size]
                updates = [self._update(param, group) for param in window]
                for param, orthogonal in zip(window, self.layout.orthogonalize(window, updates, self.ns_dtype)):
                    self._apply(param, orthogonal, group)
        return None

    def _update(self, param, group) -> torch.Tensor:
        """The momentum update of one tensor: elementwise, so a chunk or shard gets what the whole would."""
        grad, state = param.grad, self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    def _apply(self, param, orthogonal: torch.Tensor, group) -> None:
        lr = group["lr"]
        param.mul_(1 - lr * group["weight_decay"])
        flat = local_tensor(param).view(-1)  # a DTensor's shard: `orthogonal` is this rank's piece
        for start, end, shape in self.layout.matrices(param):
            flat[start:end].add_(orthogonal[start:end], alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape))
