"""Looking inside a run: torch.profiler traces of chosen steps, CUDA memory snapshots, and each
rank's peak memory in the step records (what `fivefold report` draws per rank).

Traces: `log.profile_steps` ("3,10-12") records CPU (and CUDA) activity of those steps on every
rank, one Chrome trace per rank and step: <log.dir>/traces/rank<R>-step<N>.json (Perfetto,
chrome://tracing). Snapshots: `log.memory_snapshot` (CUDA) records the allocator's history from
the first step and writes <log.dir>/memory/rank<R>-end.pickle at the end and rank<R>-oom.pickle when
the run runs out of memory (pytorch.org/memory_viz reads both).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fivefold import torch_internals
from fivefold.config import Config
from fivefold.config.file_errors import FileProblem, guarded, os_problem
from fivefold.config.validate_run import parse_steps
from fivefold.parallel.collectives import all_reduce_scalars
from fivefold.train.metrics import FIX


class StepProfiler:
    """start(step) / stop(step) around each step; only the chosen steps are recorded."""

    def __init__(self, cfg: Config, rank: int, device: torch.device):
        self.steps = parse_steps(cfg.log.profile_steps)
        self.folder = Path(cfg.log.dir) / "traces"
        self.rank = rank
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._running = None

    def start(self, step: int) -> None:
        if step in self.steps:
            self._running = torch.profiler.profile(activities=self.activities, record_shapes=True)
            self._running.start()

    def stop(self, step: int) -> None:
        if self._running is not None:
            self._running.stop()
            running, self._running = self._running, None
            path = self.folder / f"rank{self.rank}-step{step}.json"
            with guarded(path, "write trace", FIX):
                self.folder.mkdir(parents=True, exist_ok=True)
                path.touch()  # the profiler's writer only logs its failures: the OS answers here instead
                running.export_chrome_trace(str(path))
                if path.stat().st_size == 0:
                    raise FileProblem(f"cannot write trace {path}: the profiler wrote nothing there (its log line "
                                      f"above says why; a full disk, most often); free space {FIX}")


class MemorySnapshots:
    """`with MemorySnapshots(cfg, rank):` around the training loop (log.memory_snapshot, CUDA)."""

    def __init__(self, cfg: Config, rank: int):
        self.on = cfg.log.memory_snapshot
        self.folder = Path(cfg.log.dir) / "memory"
        self.rank = rank

    def __enter__(self) -> "MemorySnapshots":
        if self.on:
            torch_internals.record_cuda_memory_history(True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.on:
            return
        reason = "oom" if exc_type is not None and issubclass(exc_type, torch.OutOfMemoryError) else "end"
        path = self.folder / f"rank{self.rank}-{reason}.pickle"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            torch_internals.dump_cuda_memory_snapshot(str(path))
        except OSError as err:
            problem = os_problem(path, err, "write memory snapshot", FIX)
            if exc_type is None:
                raise problem from None
            # The run's own error (an out-of-memory) is the report; the lost snapshot is said beside it.
            print(f"warning: {problem}", file=sys.stderr, flush=True)
        finally:
            torch_internals.record_cuda_memory_history(False)


def per_rank(value: float, device: torch.device) -> list[float]:
    """Each rank's `value`, in rank order, on every rank (a collective over the world)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    mine = [0.0] * dist.get_world_size()
    mine[dist.get_rank()] = value
    return all_reduce_scalars(mine, None, device).tolist()
