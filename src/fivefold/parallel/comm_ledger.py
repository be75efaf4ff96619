"""The communication ledger: bytes this rank sends per step in each parallel dimension.

Each collective we issue is entered with its tensor's size and group, and counted as the bytes a
rank sends under the ring algorithm (all-reduce 2(N-1)/N of the buffer, reduce-scatter and
all-gather (N-1)/N of the full buffer). Collectives issued inside PyTorch (FSDP2, DTensor) are
entered by the code that knows their schedule.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class CommLedger:
    def __init__(self):
        self._bytes: dict[str, float] = defaultdict(float)

    def add(self, dim: str, nbytes: float) -> None:
        self._bytes[dim] += nbytes

    def all_reduce(self, dim: str, tensor: torch.Tensor, group_size: int) -> None:
        self.add(dim, 2 * (group_size - 1) / group_size * tensor.numel() * tensor.element_size())

    def reduce_scatter(self, dim: str, full: torch.Tensor, group_size: int) -> None:
        self.add(dim, (group_size - 1) / group_size * full.numel() * full.element_size())

    all_gather = reduce_scatter  # same bytes: (N-1)/N of the gathered tensor

    def take(self) -> dict[str, int]:
        """Bytes since the last call, per dimension (and the step's record starts afresh)."""
        out = {dim: int(round(n)) for dim, n in self._bytes.items()}
        self._bytes.clear()
        return out
