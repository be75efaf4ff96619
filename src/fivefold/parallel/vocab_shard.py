"""A vocabulary split evenly over the tp ranks, as the chunked losses (models/loss/cross_entropy.py,
models/loss/linear_cross_entropy.py) need it: where this rank's columns begin, and the two reductions
over the ranks holding the others."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from fivefold.torch_internals import c10d_functional as _c10d


class VocabShard:
    """This rank's columns of a vocabulary split evenly over a 1-D mesh (the tp group)."""

    def __init__(self, first: int, group_name: str):
        self.first, self.group_name = first, group_name

    @staticmethod
    def of(logits: DTensor) -> "VocabShard | None":
        """The shard of logits laid out over the vocabulary on a 1-D mesh; None for any other layout."""
        mesh, placements = logits.device_mesh, logits.placements
        if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], Shard):
            return None
        if placements[0].dim % logits.ndim != logits.ndim - 1 or logits.shape[-1] % mesh.size():
            return None
        local = logits.shape[-1] // mesh.size()
        return VocabShard(mesh.get_local_rank() * local, mesh.get_group().group_name)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return _c10d.wait_tensor(_c10d.all_reduce(t.contiguous(), "max", self.group_name))

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return _c10d.wait_tensor(_c10d.all_reduce(t.contiguous(), "sum", self.group_name))
