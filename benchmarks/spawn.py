"""Run one function on N local gloo ranks, each a fresh spawned process, and collect what each rank
returns: the rank-spawning the multi-rank benchmarks share.

Each rank gets torchrun's environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE) and one thread, so that ranks sharing the machine's cores do not oversubscribe
them. A rank that raises or dies ends the run with its traceback or exit code, instead of leaving
the parent waiting out the timeout. `fn` must be a module-level function: spawn sends it by name.
"""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback

import torch
import torch.multiprocessing as mp

from fivefold.train.launch import free_port


def _rank_main(rank: int, world: int, port: int, group_timeout_s: float | None, fn, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if group_timeout_s is not None:
            dist.init_process_group("gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=group_timeout_s))
        results.put((rank, "ok", fn(*args)))
    except BaseException:  # noqa: BLE001 - the parent says why, rather than waiting for this rank
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(world: int, fn, *args, timeout_s: float = 1200, group_timeout_s: float | None = 600) -> list:
    """fn(*args) on ranks 0 .. world-1; what each returned, in rank order.

    With group_timeout_s, a gloo process group of the ranks is up while fn runs (its collectives
    give up after that many seconds); None starts none, for a fn that starts its own (fivefold's
    trainer does, from the environment, and a benchmark may count that as start-up time)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, group_timeout_s, fn, args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    values, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(values) < world:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(values))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s")
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            values[rank] = value
        for p in procs:
            p.join()
    finally:
        for p in procs:  # after a failure: the other ranks may be waiting in a collective
            if p.is_alive():
                p.kill()
    return [values[r] for r in range(world)]
