"""Starting ranks: `fivefold train CONFIG --nproc N` launches N local workers through torch's
elastic launcher (what torchrun uses); under torchrun the worker code runs directly."""

from __future__ import annotations

import os
import socket
import sys
import uuid

from fivefold.config import ConfigError, load_config


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_cpu_threads() -> None:
    """Ranks sharing a CPU split its cores instead of each taking all of them."""
    import torch

    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def worker(config_path: str | None, overrides: list[str]) -> None:
    """One rank's whole job. A ConfigError found late (e.g. data) prints its sentence, not a traceback."""
    from fivefold.train.trainer import train

    set_cpu_threads()
    cfg = None
    try:
        cfg = load_config(config_path, overrides)
        train(cfg)
    except ConfigError as err:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except RuntimeError as err:  # a collective timed out: say at which step, not only where in c10d
        from fivefold.train import faults

        if cfg is None or not faults.is_timeout(err):
            raise
        print(f"error: {faults.timeout_message(cfg, int(os.environ.get('RANK', 0)))}", file=sys.stderr,
              flush=True)
        raise SystemExit(3) from None


def launch_local(config_path: str | None, overrides: list[str], nproc: int, max_restarts: int,
                 nnodes: int = 1, node_rank: int = 0, rdzv: str = "", rdzv_id: str = "fivefold") -> int:
    """nproc ranks on this machine; with nnodes > 1, this launcher is one of nnodes that meet at
    `rdzv` (HOST:PORT of node 0, which hosts torch's c10d rendezvous store) and share one run id.
    Each launcher's ranks are consecutive global ranks (elastic numbers them node by node), so
    with tp innermost in parallel.order and tp dividing nproc a tp group never leaves a node."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nnodes > 1:
        config = LaunchConfig(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc, run_id=rdzv_id,
                              rdzv_backend="c10d", rdzv_endpoint=rdzv, rdzv_configs={"is_host": node_rank == 0},
                              max_restarts=max_restarts, monitor_interval=0.5, start_method="spawn")
    else:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:8],
                              rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
                              max_restarts=max_restarts, monitor_interval=0.5, start_method="spawn")
    try:
        elastic_launch(config, worker)(config_path, overrides)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode == 2:  # the worker already printed its one-sentence config error
            return 2
        print(f"error: rank {rank} failed (exit code {failure.exitcode}); its error:\n{failure.message}",
              file=sys.stderr)
        return 1
    return 0
