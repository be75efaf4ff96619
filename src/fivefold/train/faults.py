"""Faults: naming the step when a collective times out, spotting a straggler rank, and the
test-only fault injection of the [debug] section (crash, hang, NaN)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from fivefold.config import Config
from fivefold.parallel.collectives import all_reduce_scalars

STRAGGLER_RATIO = 1.5  # a rank this much slower than the median step time is reported


class progress:  # noqa: N801 - a namespace: the step this process is running (0: not started)
    step = 0


def restart_count() -> int:
    """How many times torch elastic has restarted this job (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def is_timeout(err: BaseException) -> bool:
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


def timeout_message(cfg: Config, rank: int) -> str:
    where = f"step {progress.step}" if progress.step else "start-up"
    return (f"rank {rank}: a collective did not complete within parallel.timeout_s={cfg.parallel.timeout_s:g}s "
            f"during {where}; another rank died or hangs there (its log says why)")


def straggler(step_time_s: float, device: torch.device) -> dict | None:
    """Every rank's step time (a collective over the world); the slowest rank when it took more
    than STRAGGLER_RATIO x the median, else None. Same answer on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    mine = [0.0] * dist.get_world_size()
    mine[dist.get_rank()] = step_time_s
    times = all_reduce_scalars(mine, None, device)  # each rank's time in its own slot
    median = times.median().item()
    slowest = int(times.argmax())
    if median > 0 and times[slowest].item() > STRAGGLER_RATIO * median:
        return {"rank": slowest, "step_time_s": times[slowest].item(), "median_step_time_s": median}
    return None


# --- test-only fault injection ([debug]) ---------------------------------------------------------

def maybe_crash(cfg: Config, step: int, rank: int) -> None:
    """Rank `debug.crash_rank` dies abruptly (crash_at_step) or goes silent (hang_at_step) as the
    step begins, in the first attempt only, so that a `--max-restarts` run can prove it recovers."""
    d = cfg.debug
    if rank != d.crash_rank or restart_count() > 0:
        return
    if d.crash_at_step == step:
        print(f"debug: rank {rank} crashing at step {step} (debug.crash_at_step)", flush=True)
        os._exit(17)  # like a lost node: no cleanup, no exception to catch
    if d.hang_at_step == step:
        time.sleep(3600)  # alive but silent: only the collective timeout can end the job


def inject_nan(cfg: Config, step: int) -> bool:
    d = cfg.debug
    return bool(d.nan_at_step) and d.nan_at_step <= step < d.nan_at_step + d.nan_steps
