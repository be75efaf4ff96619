"""Where this process runs: rank, world size, device, and the default process group.

The launcher (ours or torchrun) describes the job in environment variables; a plain `python`
process without them is a one-rank job that never creates a process group.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def runtime_from_env() -> Runtime:
    """Read the job shape without creating anything (validation runs before any process group)."""
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    return Runtime(rank, world, local_rank, device)


def resolve_backend(backend: str, cuda: bool) -> str:
    """parallel.backend as torch.distributed names it. auto: on CUDA, nccl for device tensors and gloo
    for host ones (PyTorch's object collectives, barriers); on CPU, gloo."""
    if backend == "auto":
        return "cpu:gloo,cuda:nccl" if cuda else "gloo"
    return backend


def init_process_group(rt: Runtime, timeout_s: float, backend: str = "auto") -> None:
    """Create the default group once, with `backend` (parallel.backend); every collective gets
    `timeout_s`. Sub-groups (DeviceMesh's, ours) inherit its backends; every collective's tensor
    lives on rt.device (parallel/collectives.py), which each backend value accepts."""
    if rt.world_size == 1 or dist.is_initialized():
        return
    if rt.device.type == "cuda":
        torch.cuda.set_device(rt.device)  # nccl, and object collectives, use the current device
    backend = resolve_backend(backend, rt.device.type == "cuda")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _restart_store(rt, timeout)
    # device_id binds the group to this GPU (eager nccl communicators that DeviceMesh then splits);
    # kept to pure nccl, the one map where that path has been run.
    dist.init_process_group(backend, timeout=timeout, device_id=rt.device if backend == "nccl" else None,
                            **({"store": store, "rank": rt.rank, "world_size": rt.world_size} if store else {}))


def _restart_store(rt: Runtime, timeout: datetime.timedelta):
    """After a --max-restarts restart the agent's store still holds the dead attempt's addresses
    under the same keys; a new rank could read a stale one and fail to connect. Give each attempt
    its own key prefix (None: first attempt, or not under torch elastic's agent store)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rt.world_size,
                           is_master=False, timeout=timeout)
    return dist.PrefixStore(f"fivefold/attempt_{attempt}", client)
