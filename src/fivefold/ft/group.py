"""One replica group's training loop under torchft (`[ft]`, docs/operations.md#in-place-healing).

Every step: a synchronous quorum of the live groups (a group behind them heals inside it, from a
live peer: ft/state.py); this group's share of the step's global batch (ft/share.py), forward and
backward on its ranks, the group's own data-parallel reduction; then one sum over the groups
through `Manager.allreduce` of the weighted gradients and loss; the step commits only when every
live group got there. A step a failure interrupts is not committed: its gradients are dropped and
it runs again under the next quorum, so every step is trained, and logged, once.

(torchft 0.2.0's DistributedDataParallel would reduce inside backward; it takes the survivor down
when a peer dies in the middle of that all-reduce, so the groups' sum is made here, after backward.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch

from fivefold.config import Config
from fivefold.config.schema import ft_micro_batch
from fivefold.config.validate_data import check_data_is_set
from fivefold.data.batches import load_training_data
from fivefold.ft import need
from fivefold.ft.share import step_share
from fivefold.ft.state import HealingState
from fivefold.runtime import Runtime
from fivefold.train.metrics import MetricsWriter
from fivefold.train.optim import build_optimizer, lr_scheduler
from fivefold.train.trainer import StepRecords, TrainResult, autocast, setup

ATTEMPT_ENV = "FIVEFOLD_FT_ATTEMPT"  # how many times the launcher has started this group before


def group_dir(job_dir: str, group: int) -> str:
    """Where a group keeps its own files (its metrics, hangs, errors); the job's metrics.jsonl stays in job_dir."""
    return str(Path(job_dir) / f"group{group}") if job_dir else ""


def train_group(cfg: Config, rt: Runtime | None = None) -> TrainResult:
    check_data_is_set(cfg)
    tf = need.torchft()
    job_dir, group, t = cfg.log.dir, cfg.ft.group, cfg.train
    cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, dir=group_dir(job_dir, group)))
    rt, par = setup(cfg, rt)
    sampler, held_out = load_training_data(cfg.data, t.seq_len, cfg.model.vocab_size, t.global_batch, t.seed)
    optimizer = par.optimizer(lambda params: build_optimizer(params, par.settings_of, t, par.muon_layout()))
    scheduler = lr_scheduler(optimizer, t)
    writer = MetricsWriter(cfg.log.dir, rt.is_main, cfg.log.every, t.steps, cfg.log.tensorboard, cfg.log.progress)
    writer.note(par.describe() + f" | replica group {group} of {cfg.ft.replicas} ({cfg.ft.mode})")
    state = HealingState(par, optimizer, scheduler, sampler)
    restarted, first, waited_from = os.environ.get(ATTEMPT_ENV, "0") != "0", True, time.monotonic()
    if restarted and cfg.debug.rejoin_delay_s:  # the live groups train without this one meanwhile
        writer.note(f"replica group {group} waits debug.rejoin_delay_s={cfg.debug.rejoin_delay_s:g} s before it joins")
        time.sleep(cfg.debug.rejoin_delay_s)
    manager = _manager(cfg, rt, state, tf)
    job_log = _JobLog(job_dir, rt.is_main)
    records = StepRecords(cfg, rt, par, writer, held_out, sampler)
    result = TrainResult(parallel=par)
    micro = ft_micro_batch(cfg)
    n_micro, dp = t.global_batch // micro, cfg.parallel.dp
    kill_step = _kill_step(cfg)
    try:
        while first or manager.current_step() < t.steps:  # done: no quorum to wait for
            manager.start_quorum()  # synchronous: a group behind the others heals here
            step = manager.current_step()
            if first and not restarted and step == 0 and manager.num_participants() < cfg.ft.replicas:
                if time.monotonic() - waited_from < cfg.parallel.timeout_s:  # the job starts with every group
                    time.sleep(0.5)
                    continue
            if state.healed_at == step:
                writer.note(f"replica group {group} healed from a live peer: continuing at step {step + 1}")
            if first and restarted and state.healed_at is None and manager.num_participants() == 1:
                writer.note(f"replica group {group} was started again, but no live group is left to heal "
                            "from (they finished or failed); it stops")
                return result
            first = False
            if step >= t.steps:
                break
            start = time.perf_counter()
            live = manager.num_participants()
            share = step_share(cfg.ft.mode, n_micro // dp, manager.participating_rank() or 0, live, group,
                               cfg.ft.replicas)
            batch = torch.cat([sampler.rank_batch(step, j, n_micro) for j in share.micro_batches(par.dp_rank, dp)])
            loss_sum = par.forward_backward(batch.to(rt.device), share.units, lambda: autocast(cfg, rt.device))
            work_time = time.perf_counter() - start
            par.finish_grads()
            if kill_step and step + 1 >= kill_step:  # debug.kill_replica (a group that healed past it: its first step)
                os.kill(os.getpid(), signal.SIGKILL)
            loss = _sum_over_groups(manager, par, loss_sum, share.weight)
            if not manager.should_commit():  # a group failed inside the step: run it again
                optimizer.zero_grad(set_to_none=True)
                writer.note(f"step {step + 1} was not committed (a replica group failed inside it); running it again")
                continue
            grad_norm = par.clip_grad_norm(t.grad_clip)
            if math.isfinite(grad_norm):
                par.optimizer_step(optimizer)
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            sampler.step = step + 1
            record = records.of_step(step, loss, grad_norm, start, work_time, measured=False)
            record["replicas_live"] = live
            result.records.append(record)
            writer.log(record)
            if manager.participating_rank() == 0:
                job_log.write(record)  # one group logs each step for the job
            records.non_finite.stop_if_too_many(step + 1)
        _write_final(cfg, rt, par, group, manager.current_step())
    finally:
        manager.shutdown(wait=False)
        writer.close()
        job_log.close()
    return result


def _manager(cfg: Config, rt: Runtime, state: HealingState, tf):
    """This group's torchft Manager: its own store (rank 0 hosts it when the group has no launcher's),
    a gloo process group linking rank r of every group, and a quorum taken before each step."""
    import torch.distributed as dist

    timeout = timedelta(seconds=cfg.parallel.timeout_s)
    if rt.world_size == 1:  # one process: no launcher's store to borrow
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        address, port = "127.0.0.1", store.port
        _keep.append(store)
    else:
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    lighthouse = cfg.ft.lighthouse if "://" in cfg.ft.lighthouse else f"http://{cfg.ft.lighthouse}"
    return tf.Manager(pg=tf.ProcessGroupGloo(timeout=timeout), load_state_dict=state.load_state_dict,
                      state_dict=state.state_dict, min_replica_size=cfg.ft.min_replicas, use_async_quorum=False,
                      timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout, rank=rt.rank,
                      world_size=rt.world_size, store_addr=address, store_port=port, lighthouse_addr=lighthouse,
                      replica_id=f"fivefold_group_{cfg.ft.group}", hostname=socket.gethostname(),
                      init_sync=False)  # every group draws the same seeded initial weights


_keep: list = []  # the store of a one-process group lives as long as the process


def _sum_over_groups(manager, par, loss_sum: torch.Tensor, weight: float) -> torch.Tensor:
    """Σ over the live groups of weight · (the group's mean gradient, its mean loss), in one
    all-reduce; the gradients are written back only once the step commits (the caller checks)."""
    from torch.distributed import ReduceOp

    params = [p for p in par.data_parallel.params if p.grad is not None]
    loss = torch.tensor([par.mean_over_dp(loss_sum.item())], device=loss_sum.device)
    flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss]).mul_(weight)
    manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.grad.numel()].view_as(p.grad))
        offset += p.grad.numel()
    return flat[-1]


def _kill_step(cfg: Config) -> int:
    """debug.kill_replica's step for this group in its first start, else 0."""
    if not cfg.debug.kill_replica or os.environ.get(ATTEMPT_ENV, "0") != "0":
        return 0
    group, _, step = cfg.debug.kill_replica.partition(":")
    return int(step) if int(group) == cfg.ft.group else 0


class _JobLog:
    """The job's metrics.jsonl: each step's record once, appended by the group ranked 0 in its quorum.

    Two groups can each hold a quorum of their own for a while (a lighthouse that missed one's
    heartbeats takes it for dead); under same_batch both then train the same step to the same
    numbers, and the first to claim the step (a file created exclusively, on this machine or a shared
    file system) logs it."""

    def __init__(self, job_dir: str, enabled: bool):
        self._file, self._claims = None, None
        if job_dir and enabled:
            self._claims = Path(job_dir) / ".ft-steps"
            self._claims.mkdir(parents=True, exist_ok=True)
            self._file = open(Path(job_dir) / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115

    def write(self, record: dict) -> None:
        if self._file is None:
            return
        try:
            os.close(os.open(self._claims / str(record["step"]), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # another group logged this step
        self._file.write(json.dumps(record) + "\n")  # one write of a whole line: groups never interleave

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _write_final(cfg: Config, rt: Runtime, par, group: int, step: int) -> None:
    """The group's last state in a line of its own (group_dir/final.json): the steps it ended at and
    a digest of its weights, which every group must share after healing."""
    weights = par.full_state_dict()
    if not (rt.is_main and cfg.log.dir):
        return
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].numpy().tobytes())
    with open(Path(cfg.log.dir) / "final.json", "w") as f:
        json.dump({"group": group, "step": step, "weights_sha256": digest.hexdigest()}, f)
