"""The pieces of Muon every layout shares (train/muon.py is the optimizer): where a tensor's
matrices are, torch's Newton–Schulz of one matrix and its cost, and the layout of tensors that hold
whole matrices. The layouts of sharded matrices build on them (parallel/data/muon_step.py for
ZeRO's flat chunks, parallel/muon_dtensor.py for tensor-parallel and FSDP2 shards)."""

from __future__ import annotations

import math

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS

NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)


def whole_matrices(shape: tuple[int, ...]) -> list[tuple[int, int, tuple[int, int]]]:
    """(start, end, shape) of each matrix of a row-major tensor: itself if 2-D, each [i] of a
    stack of matrices (experts: [n_experts, rows, cols])."""
    rows, cols = shape[-2:]
    size = rows * cols
    return [(i * size, (i + 1) * size, (rows, cols)) for i in range(math.prod(shape[:-2]))]


def newton_schulz(update: torch.Tensor, ns_dtype: str = "bf16") -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of one 2-D matrix (its function, its defaults) in bf16;
    the same iteration in fp32 with ns_dtype = "fp32" (train.muon_ns_dtype)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    if ns_dtype == "bf16":
        return _zeropower_via_newtonschulz(update, NS_COEFFICIENTS, DEFAULT_NS_STEPS, EPS)
    return _newton_schulz_fp32(update)


def _newton_schulz_fp32(update: torch.Tensor) -> torch.Tensor:
    """torch's quintic Newton–Schulz step for step, in fp32: torch's function casts its input to
    bf16 with no way to ask otherwise, and each step multiplies a difference in its input by up to
    the polynomial's slope at zero (a = 3.44), so a bf16 rounding flipped by a reassociated
    gradient grows ~500x over 5 steps."""
    a, b, c = NS_COEFFICIENTS
    wide = update.shape[0] > update.shape[1]
    x = (update.T if wide else update).float()
    x = x / x.norm().clamp(min=EPS)  # spectral norm at most 1
    for _ in range(DEFAULT_NS_STEPS):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if wide else x


class WholeTensors:
    """Every tensor holds whole matrices on this rank: orthogonalise each here."""

    window = 1  # nothing to wait for: one tensor at a time

    def describe(self, tensors: list[torch.Tensor]) -> str:
        flops = sum(ns_flops(shape) for t in tensors for _, _, shape in whole_matrices(tuple(t.shape)))
        return shares_note("each rank orthogonalises the whole matrices it holds (nothing to gather)", [flops])

    def matrices(self, tensor: torch.Tensor):
        return whole_matrices(tuple(tensor.shape))

    def orthogonalize(self, tensors: list[torch.Tensor], updates: list[torch.Tensor],
                      ns_dtype: str = "bf16") -> list[torch.Tensor]:
        return [self.orthogonalize_here(t, u, ns_dtype) for t, u in zip(tensors, updates)]

    def orthogonalize_here(self, tensor: torch.Tensor, update: torch.Tensor, ns_dtype: str = "bf16") -> torch.Tensor:
        """Each matrix of `tensor` (whose update here is `update`), flat."""
        flat, out = update.reshape(-1), torch.empty(update.numel(), dtype=update.dtype, device=update.device)
        for start, end, shape in whole_matrices(tuple(tensor.shape)):
            out[start:end] = newton_schulz(flat[start:end].view(shape), ns_dtype).reshape(-1)
        return out


def ns_flops(shape: tuple[int, int]) -> int:
    """Newton–Schulz flops of one matrix: 5 steps of three products of the small side's Gram."""
    small, large = sorted(shape)
    return 5 * (2 * small * small * large + 2 * small ** 3 + 2 * small * small * large)


def shares_note(where: str, shares: list[int]) -> str:
    """The run log's line on Muon's work (said once): each rank's Newton–Schulz share."""
    mean = sum(shares) / len(shares)
    spread = f" (largest / mean {max(shares) / mean:.2f})" if len(shares) > 1 and mean else ""
    return (f"muon: {where}; Newton–Schulz GFLOP per step by rank: "
            f"{', '.join(f'{s / 1e9:.3g}' for s in shares)}{spread}")
