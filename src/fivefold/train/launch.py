"""Starting ranks: `fivefold train CONFIG --nproc N` launches N local workers through torch's
elastic launcher (what torchrun uses); under torchrun the worker code runs directly.

When a rank fails, torch elastic notices its exit within `monitor_interval` and stops the others,
so a job never waits for a collective timeout. Each failing rank writes why (one sentence, a
`faults.Failure`) to a file in the launcher's error folder instead of printing it; the launcher
prints the first real failure once, not N copies, nor the echoes (timeouts, lost peers) of
the ranks that were waiting for it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid

from fivefold.config import ConfigError
from fivefold.configure import load_config
from fivefold.config.file_errors import FileProblem
from fivefold.train.faults import ERROR_DIR
from fivefold.train.launch_failures import launch_problem


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
    """One rank's whole job. Whatever ends it becomes one sentence (faults.describe): handed to
    our launcher, or printed here when there is none (one process, torchrun)."""
    from fivefold.train import faults, hangs, preemption
    from fivefold.train.trainer import train

    set_cpu_threads()
    hangs.enable_flight_recorder()  # before the process group: its collectives are recorded from the first
    cfg, rank = None, int(os.environ.get("RANK", 0))
    try:
        cfg = load_config(config_path, overrides)
        if cfg.ft.replicas:  # one replica group of in-place healing (ft/group.py)
            from fivefold.ft.group import train_group

            train_group(cfg)
        else:
            train(cfg)
    except preemption.Stopped as stop:  # saved on a signal: say where, once, and exit for a requeue
        if os.environ.get(ERROR_DIR):
            _hand_to_launcher(faults.Failure(stop.sentence, preemption.EXIT_CODE, stopped=True), rank)
        elif rank == 0:
            print(stop.sentence, file=sys.stderr, flush=True)
        raise SystemExit(preemption.EXIT_CODE) from None
    except Exception as err:
        failure = faults.describe(err, cfg, rank)
        met = _env_launch_problem(err, cfg)
        if met is not None:  # the process group never formed: its address, and the fix
            failure = faults.Failure(*met)
        if cfg is not None and faults.is_timeout(err):
            hangs.write_record(hangs.folder(cfg.log.dir), rank, faults.progress.step, err)
        if os.environ.get(ERROR_DIR):
            _hand_to_launcher(failure, rank)
        elif failure.traceback:
            raise  # a bug in a process of its own: its traceback is the report
        # A bad input every rank shares: rank 0 says it; a file only this rank failed on: this rank.
        elif rank == 0 or not isinstance(err, ConfigError) or isinstance(err, FileProblem):
            print(f"error: {failure.sentence}", file=sys.stderr, flush=True)
        raise SystemExit(failure.exit_code) from None


def _env_launch_problem(err: BaseException, cfg) -> tuple[str, int] | None:
    """A rank started by torchrun (or by hand with RANK, MASTER_ADDR, MASTER_PORT) that could not
    form the process group: the address it was given and who sets it."""
    import torch.distributed as dist

    if dist.is_initialized():  # formed: a later store or network error is a lost peer (faults.describe)
        return None
    address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    flag = ("torchrun's --rdzv-endpoint (here MASTER_ADDR:MASTER_PORT)" if "TORCHELASTIC_RUN_ID" in os.environ
            else "MASTER_ADDR:MASTER_PORT")
    return launch_problem(err, address, flag, int(os.environ.get("WORLD_SIZE", 1)),
                          cfg.parallel.timeout_s if cfg is not None else None)


def _hand_to_launcher(failure, rank: int) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    record = {"rank": rank, "attempt": attempt, "time": time.time(), "sentence": failure.sentence,
              "exit_code": failure.exit_code, "echo": failure.echo, "traceback": failure.traceback,
              "stopped": failure.stopped}
    path = os.path.join(os.environ[ERROR_DIR], f"attempt{attempt}-rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)  # whole or absent: the launcher may read it at any moment


def first_failure(error_dir: str, attempt: int) -> dict | None:
    """The failure to report of an attempt: the earliest that is not an echo of another; an echo
    only when no rank said more."""
    records = []
    for name in os.listdir(error_dir):
        if name.startswith(f"attempt{attempt}-") and name.endswith(".json"):
            with open(os.path.join(error_dir, name)) as f:
                records.append(json.load(f))
    return min(records, key=lambda r: (r["echo"], r["time"])) if records else None


def stopped_record(error_dir: str) -> dict | None:
    """A rank's record of a stop on a signal (train/preemption.py), of any attempt: the lowest rank's."""
    records = []
    for name in os.listdir(error_dir):
        if name.endswith(".json"):
            with open(os.path.join(error_dir, name)) as f:
                record = json.load(f)
            if record.get("stopped"):
                records.append(record)
    return min(records, key=lambda r: r["rank"]) if records else None


def _keep_traceback(record: dict, log_dir: str) -> str:
    """Where a bug's traceback is kept for the user to read (the run folder, else a temp file)."""
    name = f"error-rank{record['rank']}.txt"
    if log_dir and os.path.isdir(log_dir):
        path = os.path.join(log_dir, name)
    else:
        path = os.path.join(tempfile.mkdtemp(prefix="fivefold-"), name)
    with open(path, "w") as f:
        f.write(record["traceback"])
    return path


def signal_name(code: int) -> str:
    """The name of the signal that killed a process whose exit code is `code` (negative)."""
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _exit_sentence(rank: int, code: int) -> str:
    if code < 0:  # killed by a signal
        name = signal_name(code)
        why = " (often the out-of-memory killer)" if -code == signal.SIGKILL else ""
        return f"rank {rank} was killed by {name}{why}; the job stopped"
    return (f"rank {rank} exited with code {code} without saying why (it was killed or called os._exit); "
            "the job stopped, its output above may say more")


def _quiet_elastic_logs() -> None:
    """torch elastic logs a failed rank as a traceback of its own monitor; we print the rank's sentence."""
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _local_config(nproc: int, max_restarts: int):
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:8],
                        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
                        max_restarts=max_restarts, monitor_interval=0.5, start_method="spawn")


def launch_local(config_path: str | None, overrides: list[str], nproc: int, max_restarts: int,
                 nnodes: int = 1, node_rank: int = 0, rdzv: str = "", rdzv_id: str = "fivefold") -> int:
    """nproc ranks on this machine; with nnodes > 1, this launcher is one of nnodes that meet at
    `rdzv` (HOST:PORT of node 0, which hosts torch's c10d rendezvous store) and share one run id.
    Each launcher's ranks are consecutive global ranks (elastic numbers them node by node), so
    with tp innermost in parallel.order and tp dividing nproc a tp group never leaves a node."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from fivefold.train import preemption

    timeout_s = load_config(config_path, overrides).parallel.timeout_s
    if nnodes > 1:  # a node that never joins ends the wait after parallel.timeout_s, with a sentence
        config = LaunchConfig(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc, run_id=rdzv_id,
                              rdzv_backend="c10d", rdzv_endpoint=rdzv,
                              rdzv_configs={"is_host": node_rank == 0, "join_timeout": timeout_s},
                              max_restarts=max_restarts, monitor_interval=0.5, start_method="spawn")
    else:
        config = _local_config(nproc, max_restarts)
    error_dir = tempfile.mkdtemp(prefix="fivefold-errors-")
    os.environ[ERROR_DIR] = error_dir  # the spawned ranks inherit it
    _quiet_elastic_logs()
    # torch elastic stops its ranks on SIGTERM/SIGINT (with that signal, then SIGKILL after 30 s);
    # SIGUSR1 (SLURM's --signal) would kill the launcher alone, so it becomes a SIGTERM.
    previous_usr1 = signal.signal(signal.SIGUSR1, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    try:
        for tries_left in (2, 1, 0):
            try:
                elastic_launch(config, worker)(config_path, overrides)
                break
            except Exception as err:  # noqa: BLE001 - only a rendezvous that never formed is handled here
                met = launch_problem(err, config.rdzv_endpoint, "--rdzv" if nnodes > 1 else "the local rendezvous",
                                     nnodes, timeout_s)
                if met is None:
                    raise
                if nnodes == 1 and met[1] == 2 and tries_left:  # another process took the free port we picked
                    config = _local_config(nproc, max_restarts)
                    continue
                print(f"error: {met[0]}", file=sys.stderr, flush=True)
                return met[1]
    except SignalException as err:  # the launcher was signalled: its ranks have stopped (or saved)
        stopped = stopped_record(error_dir)
        print(stopped["sentence"] if stopped else
              f"stopped by {err.sigval.name} before the ranks reached a step boundary; the last complete "
              f"checkpoint is where checkpoint.resume=auto continues", file=sys.stderr, flush=True)
        return preemption.EXIT_CODE
    except ChildFailedError as err:
        stopped = stopped_record(error_dir)
        if stopped is not None:  # every rank saved and stopped on a signal, at the same step
            print(stopped["sentence"], file=sys.stderr, flush=True)
            return preemption.EXIT_CODE
        attempt = max_restarts  # the job fails only once every restart has been spent
        record = first_failure(error_dir, attempt)
        # A rank that died without a word (os._exit, a signal other than the launcher's SIGTERM) came
        # before the echoes of the ranks that lost it.
        # (A rank ended by the launcher's SIGTERM dies of it, or exits 128+15: train/preemption.py.)
        stopped_by_us = (-signal.SIGTERM, 128 + signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGINT)
        silent = {rank: f.exitcode for rank, f in err.failures.items()
                  if f.exitcode not in stopped_by_us and not os.path.exists(
                      os.path.join(error_dir, f"attempt{attempt}-rank{rank}.json"))}
        if silent and (record is None or record["echo"]):
            rank = min(silent)
            print(f"error: {_exit_sentence(rank, silent[rank])}", file=sys.stderr, flush=True)
            return 1
        if record is None:  # every rank was stopped by the launcher: nothing more to say
            rank, failure = err.get_first_failure()
            print(f"error: {_exit_sentence(rank, failure.exitcode)}", file=sys.stderr, flush=True)
            return 1
        sentence = record["sentence"]
        log_dir = load_config(config_path, overrides).log.dir
        if record["traceback"]:
            sentence += f" (its traceback: {_keep_traceback(record, log_dir)})"
        print(f"error: {sentence}", file=sys.stderr, flush=True)
        if record["echo"]:  # a timeout or a lost peer: which collective, which group, who never came
            from fivefold.train import hangs

            diagnosis = hangs.diagnose(hangs.folder(log_dir))
            if diagnosis:
                print(diagnosis, file=sys.stderr, flush=True)
        return record["exit_code"]
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)
        os.environ.pop(ERROR_DIR, None)
        shutil.rmtree(error_dir, ignore_errors=True)
    return 0
