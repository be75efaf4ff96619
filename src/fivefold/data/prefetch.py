"""The next step's batch, read in a background thread while this step computes.

Reading windows from memory-mapped shards (page faults, copies, pinning for the GPU) is host work
that would otherwise sit between two steps. What is read is still a pure function of the step
number (`GlobalBatches.rank_batch`), so prefetching never changes which tokens a step sees.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


class BatchPrefetcher:
    def __init__(self, batches, rank: int, ranks: int, device: torch.device, last_step: int):
        self.batches, self.rank, self.ranks, self.device, self.last_step = batches, rank, ranks, device, last_step
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fivefold-batches")
        self._ahead: dict[int, object] = {}

    def _read(self, step: int) -> torch.Tensor:
        batch = self.batches.rank_batch(step, self.rank, self.ranks)
        # From pinned memory the copy to the GPU is asynchronous; from pageable memory it is not.
        return batch.pin_memory() if self.device.type == "cuda" else batch

    def get(self, step: int) -> torch.Tensor:
        """Step `step`'s batch on the device; starts reading step+1's."""
        future = self._ahead.pop(step, None)
        batch = future.result() if future is not None else self._read(step)
        if step + 1 < self.last_step:
            self._ahead[step + 1] = self._pool.submit(self._read, step + 1)
        return batch.to(self.device, non_blocking=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
