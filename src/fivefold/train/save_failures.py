"""A checkpoint save that the storage refused, as one sentence: which checkpoint, what the disk
said, the fix, and that the previous checkpoint is untouched (a save only becomes visible by its
final rename, and `latest` moves after it: train/checkpoint.py).

DCP gathers every rank's error of a collective save into one CheckpointException; the first
OSError inside it is the storage's answer, whichever rank met it.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from fivefold.config.file_errors import FileProblem, os_problem

LATEST = "latest"  # the same name as checkpoint.LATEST (checkpoint.py imports this module)


def storage_error(err: BaseException) -> OSError | None:
    """The OSError behind a failed save: `err` itself, or the first one a rank reported to DCP."""
    if isinstance(err, OSError):
        return err
    if isinstance(err, CheckpointException):
        for rank in sorted(err.failures):
            failure = err.failures[rank]
            inner = failure[0] if isinstance(failure, tuple) else getattr(failure, "exc", failure)
            if isinstance(inner, OSError):
                return inner
    return None


def previous_checkpoint(root: Path) -> str:
    try:
        name = (root / LATEST).read_text().strip()
    except OSError:
        name = ""
    return (f"the previous checkpoint {root / name} is intact" if name else
            "no earlier checkpoint was touched")


def save_problem(root: Path, final: Path, err: OSError) -> FileProblem:
    problem = os_problem(final, err, "write checkpoint",
                         "or set checkpoint.dir to another folder")
    return FileProblem(f"{problem}; {previous_checkpoint(root)}")
