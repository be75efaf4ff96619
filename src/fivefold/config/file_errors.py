"""The boundary between a job's files and its user: when the operating system or a file-format
library fails on a file (a full disk, an I/O error, a denied permission, a path of the wrong kind,
a file cut short or malformed), the user reads one sentence naming the file, the problem and the
fix, not the library's traceback.

`FileProblem` is a `ConfigError`, so the CLI and the launcher print it like any bad input (exit
code 2) and the launcher reports it once however many ranks hit it. Callers catch only the errors
they mean (OSError, and the format library's own error types) at the read or write they guard.
"""

from __future__ import annotations

import errno
from contextlib import contextmanager
from pathlib import Path

from fivefold.config.errors import ConfigError


class FileProblem(ConfigError):
    """A file or folder of the job that could not be read or written, in one sentence."""


# errno -> (what happened to the file, in words; the usual fix). A caller's own fix, which names the
# key or command to change, is said after it.
_MEANING = {
    errno.ENOSPC: ("the disk is full", "free space on that disk"),
    errno.EDQUOT: ("the disk quota is used up", "free space under your quota"),
    errno.EFBIG: ("the file passed the file-size limit", "raise the limit (ulimit -f)"),
    errno.EIO: ("the storage reported an input/output error", "check the disk or network file system "
                "(dmesg, the storage's health), then retry"),
    errno.EACCES: ("permission denied", "give this user access to it"),
    errno.EPERM: ("operation not permitted", "give this user access to it"),
    errno.EROFS: ("the file system is read-only", "use a writable file system"),
    errno.EEXIST: ("it already exists", "move it away"),
    errno.ENOTDIR: ("a part of the path is a file, not a folder", "correct the path"),
    errno.EISDIR: ("it is a folder, not a file", "give the path of a file"),
    errno.ENOENT: ("it does not exist", "check the path"),
    errno.ENAMETOOLONG: ("the path is too long", "use a shorter path"),
}


def os_meaning(err: OSError) -> tuple[str, str]:
    """(what happened to the file, in words; the usual fix) of an OSError."""
    return _MEANING.get(err.errno, (err.strerror or type(err).__name__, "check the path and the disk"))


def os_problem(path, err: OSError, action: str, fix: str = "") -> FileProblem:
    """The sentence of an OSError met while `action` ("write", "read", "create") the file `path`.
    The path the OS names (err.filename) wins: it is the file that failed, e.g. inside a folder."""
    where = err.filename if isinstance(err.filename, str) and err.filename else str(path)
    what, usual = os_meaning(err)
    # A caller's fix that starts with "or" offers another way ("... or set checkpoint.dir ...").
    fixes = f"{usual} {fix}" if fix.startswith("or ") else "; ".join(f for f in (usual, fix) if f)
    return FileProblem(f"cannot {action} {where}: {what}; {fixes}")


def verb(err: OSError, output, writing: str = "write") -> str:
    """"read" when the OS names a file outside `output` (an input of the job), else `writing`."""
    name = err.filename if isinstance(err.filename, str) else ""
    inside = not name or Path(name).resolve().is_relative_to(Path(output).resolve())
    return writing if inside else "read"


def malformed(path, what: str, detail, fix: str) -> FileProblem:
    """A file that exists but is not what it should be: cut short, corrupt or of another format."""
    detail = str(detail).strip().splitlines()[0][:200] if str(detail).strip() else ""
    return FileProblem(f"{path} is not a valid {what}{f' ({detail})' if detail else ''}; {fix}")


@contextmanager
def guarded(path, action: str, fix: str = "", what: str = "", formats: tuple[type[BaseException], ...] = ()):
    """Reads or writes of `path` inside: an OSError becomes `os_problem`, and an error of the format
    library (`formats`: e.g. json.JSONDecodeError, SafetensorError) becomes `malformed` as `what`."""
    try:
        yield
    except ConfigError:  # already one sentence (and a ValueError, which `formats` may name)
        raise
    except OSError as err:
        raise os_problem(path, err, action, fix) from None
    except formats as err:
        raise malformed(path, what or "file", err, fix or "write it again") from None


def _refuse_under_a_file(path: Path, role: str, fix: str) -> None:
    """One sentence when the nearest existing folder above `path` is in fact a file."""
    under = next((p for p in path.parents if p.exists()), None)
    if under is not None and not under.is_dir():
        raise FileProblem(f"{role} {path} is under {under}, which is a file, not a folder; {fix}")


def need_folder(path, role: str, fix: str) -> Path:
    """`path` must be an existing folder: one sentence when it is missing, a file, or under a file."""
    path = Path(path)
    if path.is_dir():
        return path
    if path.exists():
        raise FileProblem(f"{role} {path} is a file, not a folder; {fix}")
    _refuse_under_a_file(path, role, fix)
    raise FileProblem(f"{role} {path} does not exist; {fix}")


def need_file(path, role: str, fix: str) -> Path:
    """`path` must be an existing file: one sentence when it is missing, a folder, or under a file."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        raise FileProblem(f"{role} {path} is a folder, not a file; {fix}")
    _refuse_under_a_file(path, role, fix)
    raise FileProblem(f"{role} {path} does not exist; {fix}")


def need_output_file(path, role: str, fix: str) -> Path:
    """A file fivefold will write (a picture, a report): not a folder, and not under a file."""
    path = Path(path)
    if path.is_dir():
        raise FileProblem(f"{role} {path} is a folder, not a file; {fix}")
    _refuse_under_a_file(path, role, fix)
    return path


def need_output_folder(path, role: str, fix: str, ours=None) -> Path:
    """A folder fivefold will create or fill: not a file, not under a file, and, when it exists and
    is not empty, one `ours(path)` recognises as fivefold's own output (so nothing else is overwritten)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileProblem(f"{role} {path} is a file, not a folder; {fix}")
    _refuse_under_a_file(path, role, fix)
    if ours is not None and path.is_dir() and any(path.iterdir()) and not ours(path):
        raise FileProblem(f"{role} {path} already holds files that fivefold did not write; give a new or "
                          f"empty folder ({fix})")
    return path
