"""Checkpoints: save every `checkpoint.every` steps, resume under any layout, survive a crash.

A checkpoint is a folder `step_NNNNNNNN/` under the checkpoint root:
  .metadata, __R_0.distcp  torch.distributed.checkpoint: each rank writes the pieces of the model,
                           the AdamW moments and its RNG state that it holds (checkpoint/sharded_io.py),
                           under single-device names and whole shapes ('model/<name>',
                           'exp_avg/<name>', 'exp_avg_sq/<name>', Muon's
                           'momentum_buffer/<name>', 'rng/cpu/<rank>')
  state.json               step, optimizer step, data-sampler position, LR-schedule state, model config
  config.toml              the whole config that produced it (for people; not read back)
  .fivefold-checkpoint     the marker: only folders holding it are ever deleted (pruning, cleanup)
No rank ever holds a whole tensor it does not train with; any layout reads any checkpoint by
asking for its own pieces (checkpoint/state_boxes.py). Nothing is unpickled on load but DCP's metadata,
through an allow-list of its own classes; tensors load with weights_only.

Atomicity: all ranks write into a hidden temporary folder; rank 0 adds state.json, renames the
folder to `step_N` and only then rewrites `latest` (itself via a rename). A job killed at any
moment leaves the previous checkpoint and a `latest` that names a complete one; leftovers of an
interrupted save are removed at the next save. Only folders fivefold wrote (the MARKER file) are
deleted: a foreign folder named like a checkpoint is left alone. Checkpoint folders must be on a file system every
rank sees (as for any multi-node checkpointing).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from fivefold.config import Config, ConfigError, to_toml
from fivefold.config.confined import inside, outside
from fivefold.config.file_errors import guarded
from fivefold.checkpoint import manifest as checkpoint_manifest
from fivefold.checkpoint import resume_checks
from fivefold.checkpoint import resume_optimizer
from fivefold.checkpoint import sharded_io
from fivefold.checkpoint.load_failures import EARLIER, state_problem, unreadable
from fivefold.checkpoint.lora_base import check_lora_resume, lora_state
from fivefold.checkpoint.save_failures import save_problem, storage_error
from fivefold.train.faults import restart_count
from fivefold.train.rerun import refuse_restart_over
from fivefold.checkpoint.step_folders import LATEST, MARKER, PREFIX, foreign, newer_latest, prune, remove_ours

FORMAT = 2  # 1: whole tensors in safetensors; 2: DCP shards

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


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {f"rng/cpu/{_rank()}": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"rng/cuda/{_rank()}"] = torch.cuda.get_rng_state()
    return out


_writer: threading.Thread | None = None  # this rank's asynchronous write in progress, if any
_write_error: list[BaseException] = []
_async_group = None  # a gloo group of its own: the writer thread's collectives never meet training's


def save(cfg: Config, step: int, par, optimizer, scheduler, sampler, is_main: bool) -> Path:
    """Write the checkpoint of `step` (steps done). Collective: every rank calls it.

    Each rank writes only its own pieces. With checkpoint.async_save, the pieces are copied to
    host memory and written by a background thread while training continues."""
    from fivefold.checkpoint.state_boxes import StateBoxes, optimizer_step

    root = checkpoint_root(cfg)
    wait_for_save()  # one write at a time, in step order
    started = time.perf_counter()  # the console's seconds: from here to the checkpoint named by `latest`
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{final.name}"
    if is_main:
        with guarded(root, "create checkpoint folder in", "or set checkpoint.dir to another folder"):
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".tmp-*"):  # an earlier save that was killed half-way
                remove_ours(stale)
            if tmp.exists():
                raise foreign(tmp)
            tmp.mkdir()
            (tmp / MARKER).write_text("written by fivefold; checkpoint folders without this file are never deleted\n")
    _barrier()  # nobody writes into the temporary folder before it is clean
    boxes = StateBoxes(par)
    tensors = {**boxes.model(), **boxes.optimizer(optimizer),
               **{k: sharded_io.whole(v) for k, v in _rng_tensors().items()}}
    sched = scheduler.state_dict()
    state = {"format": FORMAT, "step": step, "optimizer_step": optimizer_step(optimizer),
             "sampler": sampler.state_dict(),
             "scheduler": {k: sched[k] for k in ("last_epoch", "_step_count", "base_lrs", "_last_lr")},
             "model": cfg.to_dict()["model"], "train": cfg.to_dict()["train"], **lora_state(cfg)}
    if cfg.checkpoint.async_save:
        global _writer, _async_group
        if _async_group is None and dist.is_initialized():
            from datetime import timedelta

            _async_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.parallel.timeout_s))
        staged = {k: sharded_io.Pieces(p.shape, p.dtype, [(o, t.detach().to("cpu", copy=True))
                                                          for o, t in p.boxes])
                  for k, p in tensors.items()}  # host copies: training may change the originals
        _writer = threading.Thread(target=_write_catching, name="checkpoint-writer",
                                   args=(cfg, root, tmp, final, staged, state, is_main, _async_group, started))
        _writer.start()
    else:
        _write(cfg, root, tmp, final, tensors, state, is_main, None, started)
        _barrier()  # no rank runs ahead (or dies) before the checkpoint is complete
    return final


def wait_for_save() -> None:
    """Block until this rank's asynchronous write (if any) is on disk; re-raise its error."""
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


def _write(cfg: Config, root: Path, tmp: Path, final: Path, tensors: dict, state: dict, is_main: bool,
           group, started: float) -> None:
    try:
        _write_files(cfg, root, tmp, final, tensors, state, is_main, group, started)
    except (OSError, CheckpointException) as err:  # DCP wraps each rank's error in the latter
        cause = storage_error(err)
        if cause is None:
            raise
        if is_main:  # DCP fails on every rank at once; rank 0 frees what the half-written save took
            remove_ours(tmp)
        raise save_problem(root, final, cause) from None


def _write_files(cfg: Config, root: Path, tmp: Path, final: Path, tensors: dict, state: dict, is_main: bool,
                 group, started: float) -> None:
    # DCP's save returns on rank 0 only after every rank's pieces are written and the metadata is.
    sharded_io.save(tensors, tmp, process_group=group)
    data_files = checkpoint_manifest.gather_files(tmp, group)  # each rank checksums what it wrote
    if not is_main:
        return
    if cfg.debug.slow_save_step == state["step"]:  # tests: a window in which to kill the job mid-save
        print(f"debug: pausing {cfg.debug.slow_save_s}s while writing {final}", flush=True)
        time.sleep(cfg.debug.slow_save_s)
    _write_json(tmp / "state.json", {**state, "manifest": True})
    (tmp / "config.toml").write_text(to_toml(cfg))
    checkpoint_manifest.write(tmp, data_files)  # last: a folder without it never was whole
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again after a restart
        if not (final / MARKER).is_file():
            raise foreign(final)
        shutil.rmtree(final)
    os.rename(tmp, final)
    newer = newer_latest(root, final.name)
    if newer is None:  # `latest` never moves back to an older step (a later resume=auto continues the newest)
        latest_tmp = root / f".tmp-{LATEST}"
        latest_tmp.write_text(final.name + "\n")
        os.replace(latest_tmp, root / LATEST)
    _fsync_dir(root)
    prune(root, cfg.checkpoint.keep, keep_name=final.name)
    size = sum(d[0] for d in json.loads((final / checkpoint_manifest.MANIFEST).read_text())["files"].values())
    print(f"saved step {state['step']} to {final} ({size / 2**20:,.1f} MiB in {time.perf_counter() - started:.1f} s)"
          + (f"; {root / LATEST} stays at the newer {newer}" if newer else ""), flush=True)


def resolve(cfg: Config) -> Path | None:
    """The checkpoint folder to resume from, or None for a fresh start. Collective once a process
    group exists (every rank verifies its share of the files: checkpoint/manifest.py).

    resume='auto' takes the newest whole checkpoint under the checkpoint root, if any: a damaged
    newer one is skipped with a warning naming it. A path names a checkpoint folder (refused, in one
    sentence naming the file, when damaged) or a root with a `latest` marker. A restart by
    --max-restarts continues from the newest whole checkpoint this run wrote, whatever `resume`
    says; only when the run has written none yet does it go back to where the first attempt started."""
    mode = cfg.checkpoint.resume
    full = cfg.checkpoint.verify == "full"  # else sizes, and checksums of the small files only
    if restart_count() > 0:
        root = checkpoint_root(cfg)
        if root is not None and (root / LATEST).is_file():
            return newest_whole(root, full)
    if mode in ("none", "auto"):
        root = checkpoint_root(cfg)
        has_checkpoint = root is not None and (root / LATEST).is_file()
        if mode == "auto" and has_checkpoint:
            return newest_whole(root, full)
        if restart_count() == 0:  # a restart goes back to where its first attempt started
            refuse_restart_over(cfg, root, has_checkpoint)
        return None
    path = Path(mode)
    if (path / "state.json").is_file():
        damage = _damage(path, full)
        if damage:
            raise ConfigError(f"checkpoint {path} is damaged: {damage}; resume from another checkpoint "
                              f"(e.g. checkpoint.resume=auto takes the newest whole one)")
        return path
    if (path / LATEST).is_file():
        return newest_whole(path, full)
    raise ConfigError(f"checkpoint.resume='{mode}' is not a checkpoint: it has no state.json and no "
                      "'latest' marker; pass a step_N folder, a checkpoint root, 'auto' or 'none'")


_verified: dict[tuple, str | None] = {}  # resolve runs twice per start: verify a folder as it is once


def _damage(path: Path, full: bool) -> str | None:
    """What makes checkpoint `path` unusable, or None (collective: see checkpoint_manifest.verify)."""
    try:
        recorded = json.loads((path / "state.json").read_text()).get("manifest")
    except OSError as err:
        return unreadable("state.json", err)
    except (ValueError, AttributeError) as err:
        return f"state.json is unreadable ({err})"
    if not recorded:
        return None  # written before manifests existed: loaded unverified, as then
    key = (str(path.resolve()), full, *sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir()))
    if key not in _verified:
        _verified[key] = checkpoint_manifest.verify(path, checksums=full)
    return _verified[key]


def newest_whole(root: Path, full: bool = False) -> Path:
    """The newest checkpoint under `root` that verifies, warning about each damaged newer one."""
    # fivefold's own step folders (a foreign one named alike is not ours to read) and what `latest` names
    with guarded(root / LATEST, "read", "or set checkpoint.resume to a step_N folder"):
        latest = inside(root, (root / LATEST).read_text().strip(), root / LATEST)
    # A step folder that is a symlink leading out of the root is not one of this root's checkpoints.
    candidates = sorted({p for p in root.glob(f"{PREFIX}*") if (p / MARKER).is_file() and outside(root, p.name) is None}
                        | {latest}, reverse=True)
    damaged = []
    for path in candidates:
        damage = (_damage(path, full) if (path / "state.json").is_file() else "state.json is missing"
                  if path.exists() else f"'{LATEST}' names it, but it does not exist")
        if damage is None:
            if damaged and _rank() == 0:
                print(f"warning: skipped damaged checkpoint{'s' if len(damaged) > 1 else ''} "
                      f"{'; '.join(damaged)}; resuming from {path}", file=sys.stderr, flush=True)
            return path
        damaged.append(f"{path} ({damage})")
    raise ConfigError(f"no whole checkpoint under {root}: {'; '.join(damaged)}; restore one from a copy, or "
                      "start afresh with checkpoint.resume=none and another checkpoint.dir")


def follow_latest(root: Path) -> Path:
    name = (root / LATEST).read_text().strip()
    path = inside(root, name, root / LATEST)
    if not (path / "state.json").is_file():
        raise ConfigError(f"checkpoint {root / LATEST} names '{name}', which is missing or incomplete; "
                          f"delete {root / LATEST} or point checkpoint.resume at a complete step_N folder")
    return path


def read_state(path: Path) -> dict:
    try:
        state = json.loads((path / "state.json").read_text())
    except OSError as err:
        raise state_problem(path, err) from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"checkpoint file {path / 'state.json'} is not valid JSON ({err}): the checkpoint "
                          f"is damaged; {EARLIER.removeprefix('or ')}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"checkpoint {path} has format {state.get('format') if isinstance(state, dict) else '?'}, "
                          f"this fivefold reads format {FORMAT}")
    return state


def read_tensors(path: Path, cfg_model=None, prefix: str = "model/") -> dict[str, torch.Tensor]:
    """Whole tensors of a checkpoint whose keys start with `prefix` (the prefix dropped), in one
    process (conversion, inspection, tests); checked against `cfg_model` first when given."""
    from fivefold.checkpoint.state_shapes import check_shapes, expected_tensors

    stored, dtypes = sharded_io.shapes(path), sharded_io.dtypes(path)
    if cfg_model is not None:
        check_shapes(path, stored, expected_tensors(cfg_model, with_optimizer=False), "model")
    tensors = {k: sharded_io.whole(torch.empty(shape, dtype=dtypes[k])) for k, shape in stored.items()
               if k.startswith(prefix)}
    sharded_io.load(tensors, path, single_process=True)
    return {k[len(prefix):]: p.boxes[0][1] for k, p in tensors.items()}


def load(cfg: Config, path: Path, par, optimizer, scheduler, sampler) -> int:
    """Restore everything from checkpoint `path`; returns the step to continue from.
    Collective: every rank reads the pieces its own layout needs."""
    from fivefold.checkpoint.state_boxes import StateBoxes
    from fivefold.checkpoint.state_shapes import check_shapes, expected_tensors

    state = read_state(path)
    resume_checks.check_model(path, state, cfg)
    check_lora_resume(path, state, cfg)
    weights_only = bool(state.get("weights_only"))  # imported weights (fivefold convert)
    if not weights_only:  # its data position comes back too
        resume_checks.check_data_position(path, state, cfg)
    stored = sharded_io.shapes(path)
    then = resume_optimizer.saved_train(state, cfg.train)
    check_shapes(path, stored, expected_tensors(cfg.model, with_optimizer=not weights_only, train=then, lora=cfg.lora),
                 "model" if weights_only else "model or optimizer")
    boxes = StateBoxes(par)
    tensors = boxes.model(for_load=True)
    rng = {}
    if not weights_only:
        tensors.update(boxes.optimizer(optimizer, for_load=True))
        switched = resume_optimizer.switched(then, cfg.train, cfg.model)
        for name in switched:  # no state of its new optimizer was saved: it stays the zeros made for it
            for key in (k for keys in resume_optimizer.STATE_KEYS.values() for k in keys):
                tensors.pop(f"{key}/{name}", None)
        if switched and _rank() == 0:
            print(resume_optimizer.warning(path, switched), file=sys.stderr, flush=True)
        for key, now in _rng_tensors().items():
            kind = key.rsplit("/", 1)[0]  # a rank the saving run did not have takes rank 0's
            source = key if key in stored else f"{kind}/0"
            if source in stored:
                rng[kind] = torch.empty_like(now)
                tensors[source] = sharded_io.whole(rng[kind])
    sharded_io.load(tensors, path)
    boxes.after_model_load()
    if weights_only:  # a fresh optimizer, data stream and schedule from step 0
        return 0
    boxes.install(optimizer, state.get("optimizer_step", state["step"]), fresh=set(switched))
    sampler.load_state_dict(state["sampler"])
    # The rule for changed training keys: this run's values win (the optimizer and schedule are
    # built from them); only the counters come from the checkpoint, and rank 0 says what changed.
    changed = resume_checks.changed_training_keys(state, cfg)
    if changed and _rank() == 0:
        print(f"warning: resuming {path} with changed training keys ({', '.join(changed)}); the new values "
              f"apply from step {state['step'] + 1}", file=sys.stderr, flush=True)
    from fivefold.train.optim import lr_multiplier

    saved, sched = state["scheduler"], scheduler.state_dict()
    lrs = [base * lr_multiplier(saved["last_epoch"], cfg.train) for base in sched["base_lrs"]]
    sched.update(last_epoch=saved["last_epoch"], _step_count=saved["_step_count"], _last_lr=lrs)
    scheduler.load_state_dict(sched)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr  # LambdaLR's load_state_dict restores its counters, not the groups' lr
    if "rng/cpu" in rng:
        torch.set_rng_state(rng["rng/cpu"])
    if "rng/cuda" in rng:
        torch.cuda.set_rng_state(rng["rng/cuda"])
    return int(state["step"])
