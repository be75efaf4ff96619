"""Faults: one sentence for whatever ends a rank (a bad input, a collective timeout, out of memory,
a bug), spotting a straggler rank, and the test-only fault injection of the [debug] section
(crash, error, hang, NaN)."""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fivefold.config import Config, ConfigError
from fivefold.config.file_errors import os_problem
from fivefold.parallel.collectives import all_reduce_scalars

STRAGGLER_RATIO = 1.5  # a rank this much slower than the median step time is reported
ERROR_DIR = "FIVEFOLD_ERROR_DIR"  # set by launch_local: where its ranks say why they stopped


class progress:  # noqa: N801 - a namespace: the step this process is running (0: not started)
    step = 0


def restart_count() -> int:
    """How many times torch elastic has restarted this job (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def another_rank_failed() -> bool:
    """Whether a rank of this attempt has already handed our launcher a failure (not a stop on a
    signal): the SIGTERM that follows is the launcher ending a failed job, not a preemption."""
    error_dir = os.environ.get(ERROR_DIR)
    if not error_dir or not os.path.isdir(error_dir):
        return False
    for name in os.listdir(error_dir):
        if name.startswith(f"attempt{restart_count()}-") and name.endswith(".json"):
            try:
                with open(os.path.join(error_dir, name)) as f:
                    if not json.load(f).get("stopped"):
                        return True
            except (OSError, ValueError):
                return True  # being written: a failure all the same
    return False


def is_timeout(err: BaseException) -> bool:
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


def timeout_message(cfg: Config, rank: int) -> str:
    where = f"step {progress.step}" if progress.step else "start-up"
    return (f"rank {rank}: a collective did not complete within parallel.timeout_s={cfg.parallel.timeout_s:g}s "
            f"during {where}; another rank died or hangs there (its log says why)")


# Words of the errors a rank sees when a peer it talks to has gone (gloo and NCCL phrasings).
_PEER_LOST = ("connection closed", "connection reset", "closed by peer", "broken pipe", "connection refused")


@dataclass
class Failure:
    """Why a rank stopped, as the user reads it: one sentence, the exit code, and whether it is
    only the echo of another rank's failure (a timeout, a lost peer), which the launcher names
    only when no rank says more."""

    sentence: str
    exit_code: int
    echo: bool = False
    traceback: str = ""  # kept for a bug, which one sentence cannot explain
    stopped: bool = False  # not a failure: the run saved and stopped on a signal (train/preemption.py)


def describe(err: BaseException, cfg: Config | None, rank: int) -> Failure:
    where = f"step {progress.step}" if progress.step else "start-up"
    if isinstance(err, ConfigError):
        return Failure(str(err), 2)
    if isinstance(err, OSError) and err.filename:  # a file no guarded read or write expected to fail
        return Failure(str(os_problem(err.filename, err, "use")), 2)
    if isinstance(err, torch.OutOfMemoryError):
        first = str(err).splitlines()[0] if str(err) else ""
        return Failure(f"rank {rank} ran out of memory during {where} ({first[:160]}); lower train.micro_batch, "
                       "shard more (parallel.zero, tp, pp) or set train.recompute", 4)
    text = str(err).lower()
    if isinstance(err, RuntimeError) and cfg is not None and is_timeout(err):
        return Failure(timeout_message(cfg, rank), 3, echo=True)
    if isinstance(err, RuntimeError) and any(word in text for word in _PEER_LOST):
        return Failure(f"rank {rank} lost contact with another rank during {where}; that rank failed first "
                       "(its error says why)", 3, echo=True)
    first = str(err).splitlines()[0] if str(err) else ""
    return Failure(f"rank {rank} failed during {where}: {type(err).__name__}: {first[:300]}", 1,
                   traceback="".join(traceback.format_exception(err)))


def straggler(work_s: float, device: torch.device) -> dict | None:
    """Every rank's own work time of a step (a collective over the world); the slowest rank when it
    took more than STRAGGLER_RATIO x the median, else None. Same answer on every rank. Ranks that
    exchange activations inside the step (tp, cp, pp, FSDP's gathers) wait there for a slow peer,
    so its group shows the delay and the report may name one of the peers."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    mine = [0.0] * dist.get_world_size()
    mine[dist.get_rank()] = work_s
    times = all_reduce_scalars(mine, None, device)  # each rank's time in its own slot
    median = times.median().item()
    slowest = int(times.argmax())
    if median > 0 and times[slowest].item() > STRAGGLER_RATIO * median:
        return {"rank": slowest, "work_s": times[slowest].item(), "median_work_s": median}
    return None


# --- test-only fault injection ([debug]) ---------------------------------------------------------

def maybe_crash(cfg: Config, step: int, rank: int) -> None:
    """Rank `debug.crash_rank` dies abruptly (crash_at_step), goes silent (hang_at_step) or raises
    (error_at_step) as the step begins, in the first attempt only, so that a `--max-restarts` run can prove it recovers."""
    d = cfg.debug
    if rank != d.crash_rank or restart_count() > 0:
        return
    if d.crash_at_step == step:
        print(f"debug: rank {rank} crashing at step {step} (debug.crash_at_step)", flush=True)
        os._exit(17)  # like a lost node: no cleanup, no exception to catch
    if d.hang_at_step == step:
        time.sleep(3600)  # alive but silent: only the collective timeout can end the job
    if d.error_at_step == step:  # an exception the trainer does not expect, as a bug would raise
        raise RuntimeError(f"injected by debug.error_at_step={step}")


def maybe_slow(cfg: Config, rank: int) -> None:
    """Rank `debug.crash_rank` does `debug.slow_step_s` seconds of extra work in every step, as a
    slower device or a busy host would: a straggler for the report to name."""
    if cfg.debug.slow_step_s and rank == cfg.debug.crash_rank:
        time.sleep(cfg.debug.slow_step_s)


def inject_nan(cfg: Config, step: int) -> bool:
    d = cfg.debug
    return bool(d.nan_at_step) and d.nan_at_step <= step < d.nan_at_step + d.nan_steps


class Injection:
    """The [debug] faults a test asks for, at the three moments of a step they act on: the loop
    calls all three every step, and nothing happens unless a debug key is set."""

    def __init__(self, cfg: Config, rank: int, stops):
        self.cfg, self.rank, self.stops = cfg, rank, stops  # stops: the run's preemption.StopRequests

    def step_began(self, step: int) -> None:
        maybe_crash(self.cfg, step, self.rank)
        maybe_slow(self.cfg, self.rank)

    def grad_norm(self, step: int, norm: float) -> float:
        return float("nan") if inject_nan(self.cfg, step) else norm

    def step_ended(self, step: int) -> None:
        self.stops.inject(self.cfg.debug, step, self.rank)
