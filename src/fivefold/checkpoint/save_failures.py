"""A checkpoint save that the storage refused, as one sentence: which checkpoint, what the disk
said, the fix, and that the previous checkpoint is untouched (a save only becomes visible by its
final rename, and `latest` moves after it: checkpoint/save_load.py).

DCP gathers every rank's error of a collective save into one CheckpointException; the first
OSError inside it is the storage's answer, whichever rank met it.
"""

from __future__ import annotations

import errno
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from fivefold.config.file_errors import FileProblem, os_problem

LATEST = "latest"  # the same name as checkpoint.LATEST (checkpoint.py imports this module)


# torch.save's zip writer, which writes DCP's tensor files, says that the storage took only part of a
# file (a full disk, a quota, the file-size limit) as a RuntimeError about positions, not the OS's error.
_CUT_SHORT = ("unexpected pos", "PytorchStreamWriter failed writing file")


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
            if isinstance(inner, RuntimeError) and any(words in str(inner) for words in _CUT_SHORT):
                return _cut_short()
    return None


def _cut_short() -> OSError:
    """The OS's likely answer to a write that stopped part-way: the file-size limit when this process
    has one (ulimit -f), else a full disk or quota, said as such (the errno itself is lost)."""
    try:
        import resource
    except ImportError:  # not on every platform
        resource = None
    if resource is not None and resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        return OSError(errno.EFBIG, "File too large")
    return OSError(0, "the storage took only part of a file (a full disk or quota, most often)")


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
