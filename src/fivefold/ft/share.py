"""Which part of step k's global batch a replica group and its data-parallel ranks run, and what
the group's gradient weighs when the groups' gradients are summed (pure arithmetic).

The global batch is cut into micro-batches of `ft_micro_batch` sequences; `units` = micro-batches /
dp, one micro-batch per dp rank each. Under ft.mode = same_batch the live groups split the units
among themselves by their rank in the step's quorum, so the step's gradient is the mean over the
whole global batch whichever groups are alive (a group's mean gradient weighs its units / all
units). Under shrink each group keeps its own units of the full-strength split (group id, not
quorum rank) and the live groups' gradients are averaged: a missing group's share is dropped,
as torchft's own data-parallel wrapper does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Share:
    first_unit: int
    units: int  # micro-batches each dp rank of the group runs
    weight: float  # what the group's mean gradient (and loss) weighs in the sum over groups

    def micro_batches(self, dp_rank: int, dp: int) -> range:
        """The indices, among the step's dp·units micro-batches, that this dp rank runs (contiguous)."""
        start = self.first_unit * dp + dp_rank * self.units
        return range(start, start + self.units)


def step_share(mode: str, units: int, live_rank: int, live: int, group: int, replicas: int) -> Share:
    if mode == "same_batch":
        first, end = live_rank * units // live, (live_rank + 1) * units // live
        return Share(first, end - first, (end - first) / units)
    first, end = group * units // replicas, (group + 1) * units // replicas
    return Share(first, end - first, 1.0 / live)
