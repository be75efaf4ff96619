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


def newton_schulz(update: torch.Tensor) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of one 2-D matrix (its own function, its defaults)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(update, NS_COEFFICIENTS, DEFAULT_NS_STEPS, EPS)


class WholeTensors:
    """Every tensor holds whole matrices on this rank: orthogonalise each here."""

    window = 1  # nothing to wait for: one tensor at a time

    def describe(self, tensors: list[torch.Tensor]) -> str:
        flops = sum(ns_flops(shape) for t in tensors for _, _, shape in whole_matrices(tuple(t.shape)))
        return shares_note("each rank orthogonalises the whole matrices it holds (nothing to gather)", [flops])

    def matrices(self, tensor: torch.Tensor):
        return whole_matrices(tuple(tensor.shape))

    def orthogonalize(self, tensors: list[torch.Tensor], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self.orthogonalize_here(t, u) for t, u in zip(tensors, updates)]

    def orthogonalize_here(self, tensor: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """Each matrix of `tensor` (whose update here is `update`), flat."""
        flat, out = update.reshape(-1), torch.empty(update.numel(), dtype=update.dtype, device=update.device)
        for start, end, shape in whole_matrices(tuple(tensor.shape)):
            out[start:end] = newton_schulz(flat[start:end].view(shape)).reshape(-1)
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
