"""Helpers for issue 52's tests: run the real `fivefold` command as its own process against a
crafted input, take the one sentence it ends with, and prove that nothing outside the run's
folders was read or written.

A read is seen in a file's access time: every file watched gets an access and modification time
three days in the past, and ext4's default `relatime` (like any atime mount) moves the access time
of such a file on its next read. `Untouched` checks first that this machine's file system does so.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

# A model and run small enough for a process to start, train and save in a few seconds.
TINY = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.ffn_dim", "128",
        "--model.max_seq_len", "32", "--train.seq_len", "32", "--train.global_batch", "4",
        "--data.builtin_max_bytes", "50000", "--log.progress", "false"]


def fivefold(*args, env: dict | None = None, timeout: float = 240, cwd=None) -> subprocess.CompletedProcess:
    """`python -m fivefold ARGS` in a process of its own, one CPU thread."""
    return subprocess.run([sys.executable, "-m", "fivefold", *[str(a) for a in args]], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def train(*args, **kwargs) -> subprocess.CompletedProcess:
    return fivefold("train", *TINY, *args, **kwargs)


def refused(done: subprocess.CompletedProcess, code: int = 2) -> str:
    """The command ended with exit `code` and exactly one `error:` line, no traceback: that line."""
    err = done.stderr
    assert done.returncode == code and "Traceback" not in err, (done.returncode, err[-3000:])
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err[-3000:]
    return errors[0].removeprefix("error: ")


def succeeded(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, done.stderr[-3000:]
    return done


_PAST = time.time() - 3 * 86400


def _times(path: Path) -> tuple:
    """(access time, modification time, size): a stat, which reads nothing."""
    st = path.stat()
    return st.st_atime_ns, st.st_mtime_ns, st.st_size


class Untouched:
    """Every file under `folders` as it is now; `check()` asserts none was read, changed, added or
    removed since. Reading them here to hash them happens before their times are set back."""

    def __init__(self, *folders: Path, but: tuple[str, ...] = ()):
        self.folders, self.but = [Path(f) for f in folders], but  # `but`: names another job may read (a lock)
        _relatime_works(self.folders[0])
        self.files = self._listing()
        self.hashes = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in self.files}
        for p in self.files:
            os.utime(p, (_PAST, _PAST))
        self.before = {p: _times(p) for p in self.files}

    def _listing(self) -> list[Path]:
        return sorted(p for f in self.folders for p in f.rglob("*")
                      if p.is_file() and not p.is_symlink() and p.name not in self.but)

    def check(self) -> None:
        now = self._listing()
        assert now == self.files, f"files were added or removed outside the run: {set(now) ^ set(self.files)}"
        for p in self.files:
            assert _times(p) == self.before[p], f"{p} was read or written"
        for p in self.files:  # last: hashing reads them
            assert hashlib.sha256(p.read_bytes()).hexdigest() == self.hashes[p], f"{p} was changed"


def _relatime_works(folder: Path) -> None:
    probe = folder / ".atime-probe"
    probe.write_text("x")
    os.utime(probe, (_PAST, _PAST))
    probe.read_text()
    moved = probe.stat().st_atime > _PAST + 3600
    probe.unlink()
    assert moved, f"the file system under {folder} does not record reads (noatime): these tests cannot see them"
