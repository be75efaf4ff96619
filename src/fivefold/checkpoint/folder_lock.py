"""A run owns its folders: rank 0 locks the run folder (log.dir) and the checkpoint root.

Two jobs writing one folder destroy each other's work: a second run's start-up removes the first's
save in progress as "leftovers", its checkpoints interleave with the first's and `latest` ends up
naming either. So each folder holds `.fivefold-lock`, an flock'ed file that names its owner (host,
pid, start time, command). A second job finds the lock held and refuses in one sentence naming the
first. The kernel drops an flock when its process dies, however it dies: a lock file whose owner is
gone is taken over with a warning naming it. Where flock is not shared between hosts (some network
file systems), the file's owner is checked too: a live process on this host, or any process on
another host, keeps the folder.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from fivefold.config import ConfigError
from fivefold.config.file_errors import guarded

LOCK = ".fivefold-lock"
_held: dict[Path, int] = {}  # lock file -> this process's open descriptor holding its flock


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "job": os.environ.get("TORCHELASTIC_RUN_ID", ""),
            "command": " ".join(sys.argv)[:300]}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _owner(text: str) -> dict | None:
    try:
        owner = json.loads(text)
    except ValueError:
        return None
    return owner if isinstance(owner, dict) and isinstance(owner.get("pid"), int) else None


def _describe(owner: dict) -> str:
    return f"pid {owner['pid']} on {owner.get('host', '?')}, started {owner.get('started', '?')}"


def acquire(folder: Path, key: str) -> str | None:
    """Hold `folder`'s lock for this process (until `release_all` or exit). Refuses in one sentence
    when another live job holds it; returns a warning when it takes over a dead job's lock."""
    folder = Path(folder)
    path = folder / LOCK
    if path.resolve() in _held:  # this process locked it already (an earlier run in the same process)
        return None
    fix = f"wait for that job to end, or set {key} to another folder"
    with guarded(folder, "create", f"or set {key} to another folder"):
        folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _owner(_read(fd))
                os.close(fd)
                who = _describe(owner) if owner else "another process"
                raise ConfigError(f"{key} {folder} is in use by another fivefold job ({who}): two jobs writing one "
                                  f"folder would destroy each other's checkpoints; {fix}") from None
            # The owner may have removed the file between our open and our lock: lock the file that is there.
            if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)
        previous = _owner(_read(fd))
        warning = None
        if previous is not None and previous["pid"] != os.getpid():
            same_host = previous.get("host") == socket.gethostname()
            if not same_host or _alive(previous["pid"]):  # flock not shared here: the file's word holds
                os.close(fd)
                raise ConfigError(f"{key} {folder} is in use by another fivefold job ({_describe(previous)}), "
                                  f"according to {path}; {fix}; if that job has ended, delete {path}")
            if not (previous.get("job") and previous.get("job") == os.environ.get("TORCHELASTIC_RUN_ID")):
                warning = (f"warning: took over {path}, left by {_describe(previous)}, which is no longer "
                           "running (it ended without releasing the folder)")
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_me()) + "\n").encode(), 0)
        os.fsync(fd)
    _held[path.resolve()] = fd
    return warning


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode(errors="replace")
    except OSError:
        return ""


def hold_run_folders(cfg) -> None:
    """Rank 0, before any process group: lock the run folder and, when checkpoints are written or
    read there, the checkpoint root; a takeover's warning goes to stderr."""
    from fivefold.checkpoint.save_load import checkpoint_root

    folders = [(Path(cfg.log.dir), "log.dir")] if cfg.log.dir else []
    root = checkpoint_root(cfg)
    c = cfg.checkpoint
    # c.dir named: a stop signal's save writes there even with checkpoint.every = 0.
    if root is not None and (c.every or c.export_hf or c.dir or root.exists()) and not (folders and root == folders[0][0]):
        folders.append((root, "checkpoint.dir"))
    for folder, key in folders:
        warning = acquire(folder, key)
        if warning:
            print(warning, file=sys.stderr, flush=True)


def release_all() -> None:
    """Let go of every folder this process holds: the lock file is removed while still locked (a job
    that opened it meanwhile finds it gone and locks the new one: `acquire`), then unlocked."""
    for path, fd in list(_held.items()):
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
            else:
                os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)  # closing drops the flock
        del _held[path]


atexit.register(release_all)
