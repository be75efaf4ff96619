"""Run a function on N gloo ranks, each in its own process, and collect what each returns.

The failing rank's traceback becomes the test failure; a rank that does not finish within the
timeout fails the test (all ranks are killed) instead of hanging the suite. `fn` must be defined
at module level (it is sent to the ranks by reference).
"""

from __future__ import annotations

import datetime
import io
import os
import queue as queue_module
import socket
import time
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, timeout_s, fn, args, kwargs, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        value = fn(*args, **kwargs)
        # Serialise to bytes: tensors sent as-is would live in this process's shared memory,
        # which is gone once it exits.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(world_size: int, fn, *args, timeout_s: float = 600, collective_timeout_s: float | None = None,
                 **kwargs) -> list:
    """fn(*args, **kwargs) on each of `world_size` ranks; returns the values, rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    # Collectives time out a little before the harness does, so a stuck rank reports itself.
    collective_timeout = collective_timeout_s or max(30.0, timeout_s - 30)
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world_size, port, collective_timeout, fn, args, kwargs, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    values: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                raise AssertionError(f"ranks {missing} did not finish within {timeout_s:.0f}s")
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    raise AssertionError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            import torch

            values[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [values[r] for r in range(world_size)]
