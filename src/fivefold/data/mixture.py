"""The global batch of step k from one source or a weighted mixture: a function of (seed, data, k).

Sequence slot p of the run (slot s of step k is p = k*global_batch + s) is assigned to a source by
a fixed schedule: slots come in blocks of `BLOCK` and each block holds every source's quota (its
weight times BLOCK, largest remainders rounded up) in a seeded shuffled order. So the shares over
any whole number of blocks equal the weights to 1/BLOCK, the source of a slot is known without
replaying the run (resume needs only the step), and a data-parallel rank reads only its own slots.
The n-th slot of a source takes its n-th window in that source's epoch order (`GlobalBatchSampler`).
"""

from __future__ import annotations

import numpy as np
import torch

from fivefold.config import ConfigError

BLOCK = 4096


def quotas(weights: list[float], block: int = BLOCK) -> np.ndarray:
    """Slots per block for each source: floor(w*block), the rest to the largest remainders."""
    exact = np.asarray(weights, dtype=np.float64) * block
    counts = np.floor(exact).astype(np.int64)
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: block - int(counts.sum())]:
        counts[i] += 1
    return counts


class MixtureSchedule:
    """Which source each slot takes, and how many slots of that source came before it."""

    def __init__(self, weights: list[float], seed: int, block: int = BLOCK):
        self.quota, self.seed, self.block = quotas(weights, block), seed, block
        self._cached: tuple[int, np.ndarray, np.ndarray] | None = None

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        if self._cached is None or self._cached[0] != b:
            sources = np.random.default_rng([self.seed, b]).permutation(np.repeat(np.arange(len(self.quota)), self.quota))
            rank = np.empty(self.block, dtype=np.int64)  # earlier slots of the same source in this block
            for s in range(len(self.quota)):
                rank[sources == s] = np.arange(self.quota[s])
            self._cached = (b, sources, rank)
        return self._cached[1], self._cached[2]

    def assign(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw number within that source) for each slot."""
        sources, draws = np.empty(len(slots), np.int64), np.empty(len(slots), np.int64)
        for b in np.unique(slots // self.block):
            here = slots // self.block == b
            block_sources, rank = self._block(int(b))
            within = slots[here] % self.block
            sources[here] = block_sources[within]
            draws[here] = b * self.quota[block_sources[within]] + rank[within]
        return sources, draws

    def drawn(self, slots: int) -> np.ndarray:
        """Slots each source took among the first `slots` of the run."""
        b, within = divmod(slots, self.block)
        return b * self.quota + np.bincount(self._block(b)[0][:within], minlength=len(self.quota))


class GlobalBatches:
    """Step k's global batch (global_batch windows of seq_len+1 tokens) from one or more splits."""

    def __init__(self, splits: list, names: list[str], weights: list[float], global_batch: int, seed: int):
        from fivefold.data.batches import GlobalBatchSampler

        self.splits, self.names, self.weights = splits, names, weights
        self.global_batch, self.seed = global_batch, seed
        self.seq_len = splits[0].seq_len
        # Each source draws its windows in its own seeded epoch order (the single source: the run's seed).
        seeds = [seed] if len(splits) == 1 else [seed * 1_000_003 + i for i in range(len(splits))]
        self.orders = [GlobalBatchSampler(s.num_windows, global_batch, sd) for s, sd in zip(splits, seeds)]
        self.schedule = MixtureSchedule(weights, seed) if len(splits) > 1 else None
        self.step = 0  # the next step to train; saved and restored with checkpoints

    @property
    def num_windows(self) -> int:
        return sum(s.num_windows for s in self.splits)

    def rank_batch(self, step: int, rank: int = 0, ranks: int = 1) -> torch.Tensor:
        """Data-parallel rank `rank`'s contiguous share of step `step`'s global batch."""
        per_rank = self.global_batch // ranks
        slots = step * self.global_batch + np.arange(rank * per_rank, (rank + 1) * per_rank)
        if self.schedule is None:
            return self.splits[0].windows(torch.from_numpy(self.orders[0].window_at(slots)))
        sources, draws = self.schedule.assign(slots)
        out = torch.empty(per_rank, self.seq_len + 1, dtype=torch.int64)
        for s in np.unique(sources):
            here = sources == s
            out[torch.from_numpy(here)] = self.splits[s].windows(torch.from_numpy(self.orders[s].window_at(draws[here])))
        return out

    def source_tokens(self, steps: int) -> dict[str, int]:
        """Tokens (inputs) each source gave the first `steps` steps of the run."""
        if self.schedule is None:
            return {self.names[0]: steps * self.global_batch * self.seq_len}
        drawn = self.schedule.drawn(steps * self.global_batch)
        return {name: int(n) * self.seq_len for name, n in zip(self.names, drawn)}

    def state_dict(self) -> dict:
        state = {"step": self.step, "seed": self.seed, "num_windows": self.num_windows,
                 "global_batch": self.global_batch}
        if self.schedule is not None:
            state["mix"] = [[n, w, s.num_windows] for n, w, s in zip(self.names, self.weights, self.splits)]
        return state

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "num_windows", "global_batch", "mix"):
            if state.get(key) != mine.get(key):
                raise ConfigError(f"the saved data position was made with {key}={state.get(key)}, this run "
                                  f"has {mine.get(key)}; resume with the same data and batch settings")
        self.step = state["step"]
