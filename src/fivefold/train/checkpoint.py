"""Checkpoints: save every `checkpoint.every` steps, resume under any layout, survive a crash.

A checkpoint is a folder `step_NNNNNNNN/` under the checkpoint root:
  model.safetensors      whole weights (and MoE bias-balancing buffers) under single-device names
  optimizer.safetensors  'exp_avg/<name>', 'exp_avg_sq/<name>', 'step/<name>', and RNG states
  state.json             step, data-sampler position, LR-schedule state, the model config
  config.toml            the whole config that produced it (for people; not read back)
The layout-independent form (parallel/state.py) is what lets any layout load any checkpoint.
Nothing is unpickled on load: safetensors and JSON only.

Atomicity: rank 0 writes into a hidden temporary folder, renames it to `step_N` when complete and
only then rewrites `latest` (itself via a rename). A job killed at any moment leaves the previous
checkpoint and a `latest` that names a complete one; leftovers of an interrupted save are removed
at the next save.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from fivefold.config import Config, ConfigError, to_toml
from fivefold.train.faults import restart_count

FORMAT = 1
LATEST = "latest"
PREFIX = "step_"


def checkpoint_root(cfg: Config) -> Path | None:
    if cfg.checkpoint.dir:
        return Path(cfg.checkpoint.dir)
    return Path(cfg.log.dir) / "checkpoints" if cfg.log.dir else None


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _rng_state() -> dict[str, torch.Tensor]:
    out = {"rng/cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["rng/cuda"] = torch.cuda.get_rng_state()
    return out


_writer: threading.Thread | None = None  # rank 0's asynchronous write in progress, if any
_write_error: list[BaseException] = []


def save(cfg: Config, step: int, par, optimizer, scheduler, sampler, is_main: bool) -> Path | None:
    """Write the checkpoint of `step` (steps done). Collective: every rank calls it.

    With checkpoint.async_save, rank 0 writes the gathered CPU copies in a background thread and
    training continues; only the gather (and the wait for the previous write) is on the step path."""
    root = checkpoint_root(cfg)
    wait_for_save()  # one write at a time, in step order
    model_sd, optim_sd = par.full_training_state(optimizer)  # gathers over every dimension (copies)
    final = root / f"{PREFIX}{step:08d}"
    if is_main:
        sched = scheduler.state_dict()
        state = {"format": FORMAT, "step": step, "sampler": sampler.state_dict(),
                 "scheduler": {k: sched[k] for k in ("last_epoch", "_step_count", "base_lrs", "_last_lr")},
                 "model": cfg.to_dict()["model"]}
        args = (cfg, root, final, model_sd, {**optim_sd, **_rng_state()}, state)
        if cfg.checkpoint.async_save:
            global _writer
            _writer = threading.Thread(target=_write_catching, args=args, name="checkpoint-writer")
            _writer.start()
        else:
            _write(*args)
    if not cfg.checkpoint.async_save:
        _barrier()  # no rank runs ahead (or dies) while the checkpoint is being written
    return final


def wait_for_save() -> None:
    """Block until rank 0's asynchronous write (if any) is on disk; re-raise its error."""
    global _writer
    if _writer is not None:
        _writer.join()
        _writer = None
    if _write_error:
        raise _write_error.pop()


def _write_catching(*args) -> None:
    try:
        _write(*args)
    except BaseException as err:  # noqa: BLE001 - reported by the next wait_for_save()
        _write_error.append(err)


def _write(cfg: Config, root: Path, final: Path, model_sd: dict, optim_sd: dict, state: dict) -> None:
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # an earlier save that was killed half-way
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:6]}"
    tmp.mkdir()
    save_file(model_sd, str(tmp / "model.safetensors"), metadata={"format": "fivefold"})
    if cfg.debug.slow_save_step == state["step"]:  # tests: a window in which to kill the job mid-save
        print(f"debug: pausing {cfg.debug.slow_save_s}s while writing {final}", flush=True)
        time.sleep(cfg.debug.slow_save_s)
    save_file(optim_sd, str(tmp / "optimizer.safetensors"), metadata={"format": "fivefold"})
    _write_json(tmp / "state.json", state)
    (tmp / "config.toml").write_text(to_toml(cfg))
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again after a restart
        shutil.rmtree(final)
    os.rename(tmp, final)
    latest_tmp = root / f".tmp-{LATEST}"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, root / LATEST)
    _fsync_dir(root)
    _prune(root, cfg.checkpoint.keep, keep_name=final.name)


def _prune(root: Path, keep: int, keep_name: str) -> None:
    if keep <= 0:
        return
    steps = sorted(p for p in root.glob(f"{PREFIX}*") if p.is_dir())
    for old in steps[:-keep]:
        if old.name != keep_name:
            shutil.rmtree(old, ignore_errors=True)


def resolve(cfg: Config) -> Path | None:
    """The checkpoint folder to resume from, or None for a fresh start.

    resume='auto' (and any restart by --max-restarts) takes the latest under the checkpoint root
    if there is one; a path names a checkpoint folder or a root with a `latest` marker."""
    mode = cfg.checkpoint.resume
    if mode == "none" and restart_count() > 0:
        mode = "auto"  # a restarted job continues from its last checkpoint
    if mode == "none":
        return None
    if mode == "auto":
        root = checkpoint_root(cfg)
        if root is None or not (root / LATEST).is_file():
            return None
        return _follow_latest(root)
    path = Path(mode)
    if (path / "state.json").is_file():
        return path
    if (path / LATEST).is_file():
        return _follow_latest(path)
    raise ConfigError(f"checkpoint.resume='{mode}' is not a checkpoint: it has no state.json and no "
                      "'latest' marker; pass a step_N folder, a checkpoint root, 'auto' or 'none'")


def _follow_latest(root: Path) -> Path:
    name = (root / LATEST).read_text().strip()
    path = root / name
    if not (path / "state.json").is_file():
        raise ConfigError(f"checkpoint {root / LATEST} names '{name}', which is missing or incomplete; "
                          f"delete {root / LATEST} or point checkpoint.resume at a complete step_N folder")
    return path


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise ConfigError(f"checkpoint file {path} is missing; the checkpoint is partial")
    try:
        return load_file(str(path))
    except Exception as err:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise ConfigError(f"checkpoint file {path} is corrupt or truncated ({err}); resume from an "
                          "earlier checkpoint") from None


def read_state(path: Path) -> dict:
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"checkpoint file {path / 'state.json'} is unreadable ({err}); the checkpoint "
                          "is corrupt") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"checkpoint {path} has format {state.get('format') if isinstance(state, dict) else '?'}, "
                          f"this fivefold reads format {FORMAT}")
    return state


def load_model_tensors(path: Path, model) -> dict[str, torch.Tensor]:
    """The checkpoint's model tensors, checked against `model` (may be on the meta device)."""
    from fivefold.parallel.state import check_shapes, expected_shapes

    tensors = _read_tensors(path / "model.safetensors")
    check_shapes(path, tensors, expected_shapes(model), "model")
    return tensors


def load(cfg: Config, path: Path, par, optimizer, scheduler, sampler) -> int:
    """Restore everything from checkpoint `path`; returns the step to continue from."""
    from fivefold.models import Transformer
    from fivefold.parallel.state import check_shapes

    state = read_state(path)
    with torch.device("meta"):
        shape_model = Transformer(cfg.model)
    model_sd = load_model_tensors(path, shape_model)
    if state.get("weights_only"):  # imported weights (fivefold convert): fresh optimizer, step 0
        par.load_training_state(model_sd, None, optimizer)
        return 0
    optim_sd = _read_tensors(path / "optimizer.safetensors")
    params = dict(shape_model.named_parameters())
    check_shapes(path, optim_sd, {f"{key}/{name}": tuple(t.shape) for name, t in model_sd.items()
                                  for key in ("exp_avg", "exp_avg_sq") if name in params}, "optimizer")
    par.load_training_state(model_sd, optim_sd, optimizer)
    sampler.load_state_dict(state["sampler"])
    sched = scheduler.state_dict()
    sched.update(state["scheduler"])
    scheduler.load_state_dict(sched)
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr  # LambdaLR's load_state_dict restores its counters, not the groups' lr
    torch.set_rng_state(optim_sd["rng/cpu"])
    if "rng/cuda" in optim_sd and torch.cuda.is_available():
        torch.cuda.set_rng_state(optim_sd["rng/cuda"])
    return int(state["step"])
