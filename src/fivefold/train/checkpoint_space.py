"""Room for a checkpoint, checked at start: a save that fills the disk fails the run at its first
checkpoint, hours in, so the free space of the checkpoint folder's disk is compared with the size
of one checkpoint of this model before the first step, and a shortfall is said once.

A checkpoint holds every parameter once in fp32 and, unless it is weights only, AdamW's two fp32
moments: 12 bytes per parameter whatever the layout (the planner's parameter count,
plan/model_stats.py). A new checkpoint is written in full before older ones are pruned, so one
checkpoint's size must be free.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from fivefold.config import Config
from fivefold.plan.model_stats import model_stats

BYTES_PER_PARAMETER = 4 + 4 + 4  # fp32 weight, AdamW exp_avg and exp_avg_sq
GB = 1e9


def checkpoint_bytes(cfg: Config) -> int:
    return model_stats(cfg.model).total_params * BYTES_PER_PARAMETER


def _existing(path: Path) -> Path:
    """The folder itself or, before its first save creates it, the nearest folder above it."""
    return next((p for p in (path, *path.parents) if p.is_dir()), Path("."))


def space_warning(cfg: Config, root: Path | None, free_bytes=None) -> str | None:
    """The warning to print when `root`'s disk has less room than one checkpoint, else None.
    `free_bytes(folder)`: the free space of a folder's disk (shutil.disk_usage's, by default)."""
    if root is None or not (cfg.checkpoint.every or cfg.checkpoint.export_hf):
        return None
    folder = _existing(root)
    free = (free_bytes or (lambda p: shutil.disk_usage(p).free))(folder)
    needed = checkpoint_bytes(cfg)
    if free >= needed:
        return None
    return (f"warning: checkpoint folder {root} has {free / GB:.2f} GB free on its disk, but one checkpoint of "
            f"this model takes about {needed / GB:.2f} GB (12 bytes per parameter); the first save will fail "
            "there: free space or set checkpoint.dir to a larger disk")
