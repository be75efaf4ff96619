"""The same command run again into a folder that already holds a run is continued or refused, never
restarted at step 1 over it.

Restarting over an earlier run silently mixes two runs: metrics.jsonl reads ...29, 30, 1, 2, its
first save moves `latest` back to step 2 (so a later `checkpoint.resume = auto` continues the wrong
run), and pruning deletes the earlier run's checkpoints. `checkpoint.resume = auto` continues from
the folder's newest whole checkpoint (checkpoint/save_load.py resolve); here, the other cases are one
sentence naming the key that decides.
"""

from __future__ import annotations

import json
from pathlib import Path

from fivefold.config import Config, ConfigError

METRICS = "metrics.jsonl"


def _last_logged_step(metrics: Path) -> int | None:
    """The step of the last record of an earlier run's metrics.jsonl, or None when it holds none."""
    try:
        with open(metrics, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))  # the tail only: a long run's file may be large
            lines = [line for line in f.read().splitlines() if line.strip()]
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            return record["step"]
    return None


def refuse_restart_over(cfg: Config, root: Path | None, has_checkpoint: bool) -> None:
    """For a run that would start at step 1: refuse when its folders hold an earlier run. `root` is
    the checkpoint root, `has_checkpoint` whether it holds a `latest`."""
    if has_checkpoint and cfg.checkpoint.resume == "none":
        raise ConfigError(f"{root} already holds the checkpoints of a run, and checkpoint.resume = none would start "
                          f"over at step 1 on top of them; continue it with checkpoint.resume = auto, or give this "
                          f"run another folder (log.dir or checkpoint.dir)")
    if not cfg.log.dir:
        return
    metrics = Path(cfg.log.dir) / METRICS
    last = _last_logged_step(metrics) if metrics.is_file() else None
    if last is not None:
        raise ConfigError(f"log.dir {cfg.log.dir} already holds a run ({METRICS} up to step {last}) and no "
                          f"checkpoint to continue it from, so this run would log steps 1, 2, ... after it; give "
                          f"this run another log.dir, or delete {metrics} to start over in that folder")
