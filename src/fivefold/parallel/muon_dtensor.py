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

    def orthogonalize(self, tensor: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, DTensor):
            return super().orthogonalize(tensor, update)
        owned = dist.get_rank() == self.owner[id(tensor)]
        return owner_to_shards(tensor, update.to_local(), owned).reshape(-1)


def owner_to_shards(param: DTensor, shard: torch.Tensor, owned: bool) -> torch.Tensor:
    """This rank's shard of the orthogonalised whole of `param`'s update, whose shard here is
    `shard` (laid out as `param`): the shards are gathered over the mesh, the owner orthogonalises
    each matrix of the whole, every other rank contributes zeros, and a sum over the mesh gives each
    rank its shard, bit for bit the owner's (one non-zero addend per element)."""
    mesh, placements = param.device_mesh, param.placements
    whole = DTensor.from_local(shard, mesh, placements, shape=param.shape, stride=param.stride()).full_tensor()
    mine = WholeTensors().orthogonalize(whole, whole).view(whole.shape) if owned else torch.zeros_like(whole)
    for dim in range(mesh.ndim):  # one all-reduce per mesh dimension (DTensor would warn it does the same)
        dist.all_reduce(mine, group=mesh.get_group(dim))
    return DTensor.from_local(mine, mesh, [Replicate()] * mesh.ndim).redistribute(mesh, placements).to_local()
