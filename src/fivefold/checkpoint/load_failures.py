"""A checkpoint's small files (state.json, `latest`) that the storage will not read, in the words of
the file boundary (config/file_errors.py), for checkpoint/save_load.py's loads: an I/O error or a denied
permission is said as what it is, with its fix, not as the library's `[Errno 5] ...: 'PATH'` nor as
a corrupt checkpoint (the file may be whole, and a retry or a permission may be all it needs).
"""

from __future__ import annotations

from pathlib import Path

from fivefold.config.file_errors import FileProblem, os_meaning, os_problem

EARLIER = "or resume from another checkpoint (checkpoint.resume = auto takes the newest whole one)"


def unreadable(name: str, err: OSError) -> str:
    """The clause of a damaged-checkpoint sentence for file `name` the OS refused to read."""
    what, usual = os_meaning(err)
    return f"{name} cannot be read ({what}; {usual})"


def state_problem(path: Path, err: OSError) -> FileProblem:
    """A checkpoint's state.json the OS refused to read, once the checkpoint was chosen."""
    return os_problem(path / "state.json", err, "read checkpoint file", EARLIER)
