"""The global gradient norm, counting every parameter element exactly once in any layout.

Each rank holds pieces of gradients: whole tensors, tensor-parallel shards, ZeRO shards. Some pieces
exist on several ranks (a replicated norm weight on every tp rank, a whole gradient on every dp
rank at ZeRO-0). Each rank sums the squares of its pieces, each divided by the number of ranks
holding an identical copy, and one all-reduce over the world adds the sums: every element then
counts once.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from fivefold.parallel.collectives import all_reduce_scalars


def copies_of_local_piece(tensor: torch.Tensor, world_size: int) -> int:
    """How many ranks hold the same local values as this rank does for `tensor`.

    A plain tensor is the same on every rank of the world that reduces this norm; a DTensor is the
    same across the mesh dimensions where it is replicated, and across every rank outside its mesh.
    """
    if not isinstance(tensor, DTensor):
        return world_size
    mesh = tensor.device_mesh
    copies = world_size // mesh.size()
    for size, placement in zip(mesh.shape, tensor.placements):
        if isinstance(placement, Replicate):
            copies *= size
    return copies


def settle_grad_layout(param: torch.Tensor) -> None:
    """Bring a gradient DTensor into its parameter's layout, so that its local values are this
    rank's piece of the real gradient: pending partial sums (a sequence-parallel norm weight: each
    tp rank saw part of the sequence) are summed, a whole gradient of a sharded weight is sliced."""
    grad = param.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(grad.device_mesh, param.placements)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def weighted_square_sum(pieces: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """Σ ||piece||² / copies: one fused norm per group of pieces with the same number of copies,
    each tensor's norm in its own precision, the sum over tensors in fp64, on the pieces' device
    (the all-reduce's: parallel/collectives.py)."""
    by_copies: dict[int, list[torch.Tensor]] = {}
    for piece, copies in pieces:
        if piece.numel():
            by_copies.setdefault(copies, []).append(piece.detach())
    # A rank may hold no piece (a ZeRO chunk of padding only): its zero still joins the all-reduce.
    device = pieces[0][0].device if pieces else torch.accelerator.current_accelerator() or torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for copies, tensors in by_copies.items():
        norms = torch.stack(torch._foreach_norm(tensors)).double()
        total += norms.pow(2).sum() / copies
    return total


def global_norm(square_sum: torch.Tensor, group=None) -> float:
    if dist.is_initialized():
        square_sum = all_reduce_scalars(square_sum, group, square_sum.device)
    return math.sqrt(square_sum.item())


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor the gradients are scaled by (1 when no clipping is needed or clipping is off)."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
