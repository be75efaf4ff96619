"""Muon over DTensor matrices (tensor parallel's Shard(0), Shard(1) and Replicate weights; FSDP2's
row shards at zero 3): each matrix orthogonalised whole, once, on one rank of its mesh, without
changing the math.

Per Muon tensor and step:
1. every rank holds its shard of the momentum update (elementwise, like the whole: train/muon.py);
2. the shards are all-gathered into the whole tensor (`full_tensor`);
3. the tensor's owner orthogonalises each matrix in it (torch's Newton–Schulz; an expert stack's
   matrices one by one) and broadcasts the result, bit for bit what the single process computes;
4. every rank keeps its own shard of it (`distribute_tensor` of the local whole: no communication).
Owners: largest tensor first to the least-loaded rank of its mesh by Newton–Schulz flops, the same
on every rank (`shares`: each mesh rank's flops). Plain tensors among them (experts under expert
parallelism: whole experts) are orthogonalised where they are. Only DTensors over one mesh
dimension: HSDP's and tp with FSDP2's two-dimensional ones are refused at validation.
Cost per step: one all-gather and one broadcast of each sharded Muon tensor.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from fivefold.parallel.muon_matrices import WholeTensors, ns_flops, shares_note, whole_matrices


def _mesh_key(mesh) -> tuple:
    return tuple(mesh.mesh.flatten().tolist())


class DTensorMatrices(WholeTensors):
    def __init__(self, params: list[torch.Tensor]):
        self.owner: dict[int, int] = {}  # id(param) -> its owner's rank in its mesh
        loads: dict[tuple, list[int]] = {}
        sharded = [(i, p) for i, p in enumerate(params) if isinstance(p, DTensor)]
        for _, param in sorted(sharded, key=lambda ip: (-self._flops(ip[1]), ip[0])):
            if param.device_mesh.ndim != 1:
                raise ValueError("Muon over a DTensor on a mesh of more than one dimension is refused at validation")
            load = loads.setdefault(_mesh_key(param.device_mesh), [0] * param.device_mesh.size())
            owner = min(range(len(load)), key=lambda r: (load[r], r))
            load[owner] += self._flops(param)
            self.owner[id(param)] = owner
        self.shares = [sum(col) for col in zip(*loads.values())] if loads else [0]

    def describe(self, tensors: list[torch.Tensor]) -> str:
        if not self.owner:
            return super().describe(tensors)
        return shares_note("each matrix orthogonalised once, on one rank of its tensor-parallel or FSDP2 "
                           "mesh (shards gathered)", self.shares)

    @staticmethod
    def _flops(param: torch.Tensor) -> int:
        return sum(ns_flops(shape) for _, _, shape in whole_matrices(tuple(param.shape)))

    def matrices(self, tensor: torch.Tensor):
        """The matrices of this rank's piece (flat ranges of the local tensor) with their whole
        shapes (for the lr): a shard of a matrix cuts its rows or columns, never a stack's matrices apart."""
        if not isinstance(tensor, DTensor):
            return whole_matrices(tuple(tensor.shape))
        local = tensor.to_local()
        size, count = math.prod(local.shape[-2:]), math.prod(local.shape[:-2])
        return [(i * size, (i + 1) * size, tuple(tensor.shape[-2:])) for i in range(count)]

    def orthogonalize(self, tensor: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, DTensor):
            return super().orthogonalize(tensor, update)
        mesh = tensor.device_mesh
        whole = update.full_tensor()
        owner = self.owner[id(tensor)]
        if mesh.get_local_rank() == owner:
            whole = super().orthogonalize(whole, whole).view(whole.shape)
        group = mesh.get_group()
        dist.broadcast(whole, src=dist.get_global_rank(group, owner), group=group)
        return distribute_tensor(whole, mesh, tensor.placements, src_data_rank=None).to_local().reshape(-1)
