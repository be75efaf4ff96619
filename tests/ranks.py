"""Run a function on N gloo ranks, each in its own process, and collect what each returns.

When ranks fail, the test failure names the rank that failed first and why: a rank whose process
died without a word (killed by a signal, e.g. out of memory) before any other, else the earliest
traceback; the others' first lines follow (their "connection closed by peer" is usually the echo of
the first failure, not its cause). A rank that dies without a word reports what it wrote to stderr
last and, from faulthandler, the Python stack of each of its threads when it died (a C++ abort, such
as gloo's from one of its threads, otherwise leaves nothing to go on). A rank that does not finish
within the timeout fails the test (all ranks are killed) instead of hanging the suite. `fn` must be
defined at module level (it is sent to the ranks by reference).

The ranks are forked from a server process that has imported torch.distributed and fivefold's
training code once for the whole session (multiprocessing's forkserver with a preload). A spawned
rank spent 2.7 s of CPU importing them, in every group of ranks of the suite, up to 16 at once on
two cores; a forked one starts in milliseconds (benchmarks/RESULTS.md, "Ranks forked from a
preloaded server"). The server imports and computes nothing else, so it holds one
thread when it forks (safe), and each rank is still a fresh process: nothing one test does in its
ranks reaches another's. The parent's environment is handed to each rank as it is at the call.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import io
import os
import queue as queue_module
import signal
import socket
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the server the ranks are forked from (what every multi-rank test reaches).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "torch.distributed.checkpoint", "fivefold.train.trainer"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _rank_main(rank, world_size, port, timeout_s, fn, args, kwargs, results, stderr_path, environ):
    # stderr into a file the parent reads when this rank dies silently; faulthandler writes the stacks there.
    stderr_file = open(stderr_path, "w", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(stderr_file.fileno(), 2)
    faulthandler.enable(file=stderr_file, all_threads=True)
    # The environment of the call, not the one the fork server started with.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        # What is alive now (torch, the test module) lives as long as the rank: the collector need
        # not walk it again at every full collection (tests/layouts.py freezes each layout's survivors).
        gc.freeze()
        value = fn(*args, **kwargs)
        # Serialise to bytes: tensors sent as-is would live in this process's shared memory,
        # which is gone once it exits.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue(), time.time()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc(), time.time()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(world_size: int, fn, *args, timeout_s: float = 600, collective_timeout_s: float | None = None,
                 **kwargs) -> list:
    """fn(*args, **kwargs) on each of `world_size` ranks; returns the values, rank order."""
    ctx = _context()
    results = ctx.Queue()
    port = _free_port()
    # Collectives time out a little before the harness does, so a stuck rank reports itself.
    collective_timeout = collective_timeout_s or max(30.0, timeout_s - 30)
    stderr_dir = tempfile.TemporaryDirectory(prefix="ranks-stderr-")
    stderr_paths = [os.path.join(stderr_dir.name, f"rank{r}.txt") for r in range(world_size)]
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world_size, port, collective_timeout, fn, args, kwargs, results, stderr_paths[r],
                               dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    values: dict[int, object] = {}
    errors: dict[int, tuple[float, str]] = {}  # rank -> (when it failed, its traceback)
    deaths: dict[int, float] = {}  # rank -> when its silent death was seen
    deadline = time.monotonic() + timeout_s
    grace_end = None  # after a first failure: a few seconds for the others' reports, then the verdict
    try:
        while len(values) + len(errors) + len(deaths) < world_size:
            now = time.monotonic()
            if grace_end is not None and now > grace_end:
                break
            if now > deadline:
                if errors or deaths:
                    break
                missing = sorted(set(range(world_size)) - set(values))
                raise AssertionError(f"ranks {missing} did not finish within {timeout_s:.0f}s")
            try:
                rank, status, value, when = results.get(timeout=min(deadline - now, 1.0))
            except queue_module.Empty:
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in values and r not in errors and r not in deaths:
                        deaths[r] = time.time()
                        grace_end = grace_end or time.monotonic() + 5
                continue
            if status == "error":
                errors[rank] = (when, value)
                grace_end = grace_end or time.monotonic() + 5
                continue
            import torch

            values[rank] = torch.load(io.BytesIO(value), weights_only=False)
        if errors or deaths:
            raise AssertionError(_failure_report(errors, deaths, procs, stderr_paths))
    finally:
        failed = len(values) < world_size  # then the ranks still running wait for peers that are gone
        for p in procs:
            p.join(timeout=1 if failed else 10)
            if p.is_alive():
                p.kill()
        _pass_on_stderr(stderr_paths)
        stderr_dir.cleanup()
    return [values[r] for r in range(world_size)]


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        return f"killed by {name}" + (" (out of memory, or killed from outside)" if name == "SIGKILL" else "")
    return f"exit code {code}"


def _failure_report(errors: dict, deaths: dict, procs, stderr_paths: list[str]) -> str:
    """The first failure in full, then one line for each other failed rank."""
    if deaths:  # a silent death comes before the errors it causes in its peers
        first = min(deaths, key=deaths.get)
        head = (f"rank {first} died first, {_exit_reason(procs[first].exitcode)}, without a traceback; "
                f"the end of its stderr:\n{_tail(stderr_paths[first])}")
    else:
        first = min(errors, key=lambda r: errors[r][0])
        head = f"rank {first} failed first:\n{errors[first][1]}"
    others = [f"  rank {r}: {_last_line(tb)}" for r, (_, tb) in sorted(errors.items()) if r != first]
    others += [f"  rank {r}: died, {_exit_reason(procs[r].exitcode)}" for r in sorted(deaths) if r != first]
    return head + ("\nthen:\n" + "\n".join(others) if others else "")


def _last_line(tb: str) -> str:
    lines = [line for line in tb.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no message)"


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]) or "(empty)"
    except OSError:
        return "(not written)"


def _pass_on_stderr(stderr_paths: list[str]) -> None:
    """What the ranks wrote to stderr, onto this process's, where pytest captures it as before."""
    for path in stderr_paths:
        text = _tail(path, lines=200)
        if text not in ("(empty)", "(not written)"):
            sys.stderr.write(text)
