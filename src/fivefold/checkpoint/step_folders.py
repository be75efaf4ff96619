"""The step folders of a checkpoint root: which are fivefold's (they hold MARKER), which `latest`
names, and which go when only the last few are kept. Nothing without the marker is ever deleted."""

from __future__ import annotations

import shutil
from pathlib import Path

from fivefold.config import ConfigError
from fivefold.config.confined import outside
from fivefold.checkpoint import manifest as checkpoint_manifest

LATEST = "latest"
PREFIX = "step_"
MARKER = ".fivefold-checkpoint"  # in every folder fivefold writes; nothing without it is deleted


def newer_latest(root: Path, name: str) -> str | None:
    """The step folder `latest` names when it is newer than `name` and whole, else None."""
    try:
        current = (root / LATEST).read_text().strip()
    except OSError:
        return None
    if current > name and outside(root, current) is None and (root / current / checkpoint_manifest.MANIFEST).is_file():
        return current
    return None


def foreign(path: Path) -> ConfigError:
    return ConfigError(f"checkpoint folder {path} already exists and was not written by fivefold "
                       f"(no {MARKER}); move it away or set another checkpoint.dir")


def remove_ours(path: Path) -> None:
    """Delete a folder fivefold wrote (it holds the MARKER); anything else is left alone."""
    if path.is_dir() and (path / MARKER).is_file():
        shutil.rmtree(path, ignore_errors=True)


def prune(root: Path, keep: int, keep_name: str) -> None:
    """Keep the last `keep` checkpoints fivefold wrote; foreign folders neither count nor go."""
    if keep <= 0:
        return
    steps = sorted(p for p in root.glob(f"{PREFIX}*") if (p / MARKER).is_file())
    for old in steps[:-keep]:
        if old.name != keep_name:
            remove_ours(old)
