"""Muon over DTensor matrices (tensor parallel's Shard(0), Shard(1) and Replicate weights; FSDP2's
row shards at zero 3, on their own or over tp's, and HSDP's replicated shards): each matrix
orthogonalised whole, once, on one rank of its mesh, without changing the math.

Per Muon tensor and step:
1. every rank holds its shard of the momentum update (elementwise, like the whole: train/muon.py);
2. the shards are all-gathered into the whole tensor (`full_tensor`, over every mesh dimension);
3. the tensor's owner orthogonalises each matrix in it (torch's Newton–Schulz; an expert stack's
   matrices one by one); every other rank holds zeros; an all-reduce over the mesh gives every rank
   the owner's result bit for bit (one non-zero addend per element);
4. every rank keeps its own shard of it (a Replicate → the tensor's placements redistribution: a
   local slice, no communication; it also knows FSDP2's strided shards over tp's).
A window of as many tensors as the largest mesh has ranks goes through each pass together (all
gathered, then each owner's orthogonalised, then all summed), so the owners work at once instead
of each tensor's collective waiting for its owner. The window's whole updates are held at once.
Owners: largest tensor first to the least-loaded rank of its mesh by Newton–Schulz flops, the same
on every rank (`shares`: each mesh rank's flops). Plain tensors among them (experts under expert
parallelism: whole experts) are orthogonalised where they are.
Cost per step: one all-gather and one all-reduce of each sharded Muon tensor.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from fivefold.parallel.muon_matrices import WholeTensors, ns_flops, shares_note, whole_matrices


def _mesh_ranks(mesh) -> tuple[int, ...]:
    """The global ranks of a mesh, flattened: an owner is one of them."""
    return tuple(mesh.mesh.flatten().tolist())


class DTensorMatrices(WholeTensors):
    def __init__(self, params: list[torch.Tensor]):
        self.owner: dict[int, int] = {}  # id(param) -> its owner's global rank
        # Flops per rank of each mesh, balanced per mesh: a mesh's owners then depend only on the
        # tensors on it, which all its ranks hold alike (the expert meshes of ep differ between ranks).
        loads: dict[tuple, list[int]] = {}
        sharded = [(i, p) for i, p in enumerate(params) if isinstance(p, DTensor)]
        for _, param in sorted(sharded, key=lambda ip: (-self.flops(ip[1]), ip[0])):
            ranks = _mesh_ranks(param.device_mesh)
            load = loads.setdefault(ranks, [0] * len(ranks))
            owner = min(range(len(ranks)), key=lambda r: (load[r], r))
            load[owner] += self.flops(param)
            self.owner[id(param)] = ranks[owner]
        by_rank: dict[int, int] = {}  # what the log says: each rank's flops over this rank's meshes
        for ranks, load in loads.items():
            for rank, flops in zip(ranks, load):
                by_rank[rank] = by_rank.get(rank, 0) + flops
        self.shares = [by_rank[r] for r in sorted(by_rank)] if by_rank else [0]
        # A window as large as the largest mesh: its tensors' owners differ (largest first to the least loaded).
        self.window = max([len(ranks) for ranks in loads] or [1])

    def describe(self, tensors: list[torch.Tensor]) -> str:
        if not self.owner:
            return super().describe(tensors)
        return shares_note("each matrix orthogonalised once, on one rank of its tensor-parallel or FSDP2 "
                           "mesh (shards gathered)", self.shares)

    @staticmethod
    def flops(param: torch.Tensor) -> int:
        return sum(ns_flops(shape) for _, _, shape in whole_matrices(tuple(param.shape)))

    @staticmethod
    def local_matrices(tensor: DTensor):
        """The matrices of this rank's piece (flat ranges of the local tensor) with their whole
        shapes (for the lr): a shard of a matrix cuts its rows or columns, never a stack's matrices apart."""
        local = tensor.to_local()
        size, count = math.prod(local.shape[-2:]), math.prod(local.shape[:-2])
        return [(i * size, (i + 1) * size, tuple(tensor.shape[-2:])) for i in range(count)]

    def matrices(self, tensor: torch.Tensor):
        if not isinstance(tensor, DTensor):
            return whole_matrices(tuple(tensor.shape))
        return self.local_matrices(tensor)

    def orthogonalize(self, tensors: list[torch.Tensor], updates: list[torch.Tensor],
                      ns_dtype: str = "bf16") -> list[torch.Tensor]:
        """A window's tensors in three passes, so that their owners work at the same time: every
        tensor gathered, each owner's orthogonalised, every result summed back into shards."""
        wholes = [gather_whole(t, u.to_local()) if isinstance(t, DTensor) else None for t, u in zip(tensors, updates)]
        mine = [owned_result(whole, dist.get_rank() == self.owner[id(t)], ns_dtype) if whole is not None
                else self.orthogonalize_here(t, u, ns_dtype) for t, u, whole in zip(tensors, updates, wholes)]
        return [shard_of_sum(t, m).reshape(-1) if isinstance(t, DTensor) else m for t, m in zip(tensors, mine)]


def gather_whole(param: DTensor, shard: torch.Tensor) -> torch.Tensor:
    """The whole update of `param` from each rank's `shard` of it (laid out as `param`): an
    all-gather over every mesh dimension that shards it."""
    return DTensor.from_local(shard, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride()).full_tensor()


def owned_result(whole: torch.Tensor, owned: bool, ns_dtype: str) -> torch.Tensor:
    """The owner's orthogonalised whole (each matrix of it on its own); zeros on every other rank."""
    if not owned:
        return torch.zeros_like(whole)
    return WholeTensors().orthogonalize_here(whole, whole, ns_dtype).view(whole.shape)


def shard_of_sum(param: DTensor, mine: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the sum over the mesh of every rank's `mine`: bit for bit the owner's
    result (one non-zero addend per element), one all-reduce per mesh dimension (DTensor would warn
    it does the same), then the local slice of the placements (no communication)."""
    mesh = param.device_mesh
    for dim in range(mesh.ndim):
        dist.all_reduce(mine, group=mesh.get_group(dim))
    return DTensor.from_local(mine, mesh, [Replicate()] * mesh.ndim).redistribute(mesh, param.placements).to_local()
