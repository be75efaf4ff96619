"""The run's own settings before any process starts: where checkpoints and logs go (folders that can
be written), what resume and export name, what the log section asks to record, and the replica
groups of in-place healing (`[ft]`) with what they do not run yet. validate()
(config/validate.py) calls these; each failure is one sentence naming the key and the fix.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from fivefold.config.errors import ConfigError, require as _require
from fivefold.config.file_errors import os_problem
from fivefold.config.schema import Config, ft_micro_batch


def check_checkpoint(cfg: Config) -> None:
    c = cfg.checkpoint
    _require(c.resume in ("none", "auto") or Path(c.resume).exists(),
             f"checkpoint.resume='{c.resume}' must be none, auto, or an existing checkpoint folder")
    if c.resume not in ("none", "auto"):  # the wrong kind of path is refused now, not after start-up
        resume = Path(c.resume)
        _require(resume.is_dir(), f"checkpoint.resume='{c.resume}' is a file, not a folder; pass a step_N folder, "
                 "a checkpoint root, 'auto' or 'none'")
        _require((resume / "state.json").is_file() or (resume / "latest").is_file(),
                 f"checkpoint.resume='{c.resume}' is not a checkpoint: it has no state.json and no 'latest' marker; "
                 "pass a step_N folder, a checkpoint root, 'auto' or 'none'")
    _require(c.every == 0 or c.dir or cfg.log.dir, "checkpoint.every > 0 needs checkpoint.dir or log.dir "
             "to say where checkpoints go")
    _require(not c.export_hf or c.dir or cfg.log.dir, f"checkpoint.export_hf='{c.export_hf}' exports the final "
             "checkpoint: set checkpoint.dir or log.dir to say where checkpoints go")
    _require(not c.export_hf or cfg.model.mlp_activation == "swiglu",
             f"checkpoint.export_hf='{c.export_hf}' needs model.mlp_activation='swiglu', not "
             f"'{cfg.model.mlp_activation}': Hugging Face's Llama has only a SwiGLU feed-forward; drop "
             "checkpoint.export_hf and keep fivefold's checkpoints")
    export = Path(c.export_hf) if c.export_hf else None
    _require(export is None or not export.exists() or (export.is_dir() and not any(export.iterdir())) or
             (export / "config.json").is_file() or (export / "adapter_config.json").is_file(),
             f"checkpoint.export_hf='{c.export_hf}' holds files that are not a Hugging Face folder or a PEFT adapter "
             "folder; give a new or empty folder (an earlier export there is replaced)")


def parse_steps(text: str) -> set[int]:
    """log.profile_steps: "3", "3,10-12" -> {3, 10, 11, 12}; ValueError when it is not that."""
    steps: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        a, b = int(first), int(last or first)
        if a < 1 or b < a:
            raise ValueError(part)
        steps.update(range(a, b + 1))
    return steps


def check_log(cfg: Config, world_size: int | None) -> None:
    g = cfg.log
    try:
        steps = parse_steps(g.profile_steps)
    except ValueError:
        raise ConfigError(f"log.profile_steps='{g.profile_steps}' must be step numbers and ranges from 1, "
                          "e.g. '3' or '3,10-12'") from None
    if steps:
        _require(max(steps) <= cfg.train.steps, f"log.profile_steps='{g.profile_steps}' names step {max(steps)}, "
                 f"after the run's last (train.steps={cfg.train.steps}); profile earlier steps")
    for key, on in (("log.profile_steps", bool(steps)), ("log.memory_snapshot", g.memory_snapshot)):
        _require(not on or bool(g.dir), f"{key} writes its files under log.dir, which is not set; set log.dir")
    if g.wandb and world_size is not None:  # a launch: the package must be there before any rank starts
        import importlib.util

        _require(importlib.util.find_spec("wandb") is not None, "log.wandb=true needs the wandb package: "
                 "pip install 'fivefold[wandb]', or set log.wandb=false")


def check_run_folders(cfg: Config) -> None:
    c = cfg.checkpoint
    check_writable_dir("log.dir", cfg.log.dir)
    if c.dir:
        check_writable_dir("checkpoint.dir", c.dir)
    elif cfg.log.dir and c.every:
        check_writable_dir("checkpoint.dir (empty: <log.dir>/checkpoints)", str(Path(cfg.log.dir) / "checkpoints"))
    for name, key in log_subfolders(cfg):
        path = Path(cfg.log.dir) / name
        _require(not path.exists() or path.is_dir(), f"{path} is a file, not a folder, but {key} writes its files "
                 "there; move it away or set log.dir to another folder")
        if path.is_dir():  # a folder an earlier run left: it must still take new files
            try:
                with tempfile.TemporaryFile(dir=path):
                    pass
            except OSError as err:
                raise os_problem(path, err, "write in", f"or set log.dir to another folder ({key} writes there)") from None


def log_subfolders(cfg: Config) -> list[tuple[str, str]]:
    """(folder under log.dir, the key that writes there) for each one this run writes into. hangs/
    holds every run's stack watchdog (train/hangs.py); wandb/ is W&B's, which would otherwise write
    to another folder without a word when it cannot use this one."""
    g = cfg.log
    if not g.dir:
        return []
    wanted = [("hangs", "the hang watchdog", True), ("tensorboard", "log.tensorboard", g.tensorboard),
              ("traces", "log.profile_steps", bool(g.profile_steps)), ("memory", "log.memory_snapshot", g.memory_snapshot),
              ("wandb", "log.wandb", g.wandb)]
    return [(name, key) for name, key, on in wanted if on]


def check_writable_dir(key: str, text: str) -> None:
    """A run folder fivefold writes into: a folder, or creatable inside a writable one. Writing is
    tried (a temporary file, removed at once): permissions alone do not tell, e.g. for root or a
    read-only mount."""
    if not text:
        return
    path = Path(text)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    fix = f"give {key.split(' ')[0]} a folder fivefold may create and write"
    _require(existing.is_dir(), f"{key}='{text}' is a file, not a folder; {fix}" if existing == path else
             f"{key}='{text}' cannot be created: '{existing}' is a file; {fix}")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise ConfigError(f"{key}='{text}' is not writable ('{existing}': {err.strerror}); {fix}") from None


def check_ft(cfg: Config) -> None:
    """`[ft]` and `debug.kill_replica`: torchft replica groups, each a whole copy of the layout."""
    f, p, t = cfg.ft, cfg.parallel, cfg.train
    if not f.replicas:
        _require(not cfg.debug.kill_replica, f"debug.kill_replica='{cfg.debug.kill_replica}' kills a replica "
                 "group, and ft.replicas=0 starts none; set ft.replicas (e.g. 2) or remove debug.kill_replica")
        _require(not cfg.debug.rejoin_delay_s, f"debug.rejoin_delay_s={cfg.debug.rejoin_delay_s} delays a restarted "
                 "replica group, and ft.replicas=0 starts none; set ft.replicas (e.g. 2) or remove debug.rejoin_delay_s")
        return
    _require(f.min_replicas <= f.replicas, f"ft.min_replicas={f.min_replicas} exceeds ft.replicas={f.replicas}, so "
             f"no step could commit; lower ft.min_replicas or raise ft.replicas")
    _require(f.group < f.replicas, f"ft.group={f.group} must be below ft.replicas={f.replicas} (groups count from 0)")
    if f.lighthouse:
        host, _, port = f.lighthouse.rpartition(":")
        _require(bool(host) and port.isdigit(), f"ft.lighthouse='{f.lighthouse}' must be HOST:PORT of a running "
                 "torchft lighthouse (e.g. node0:29510), or empty for `fivefold train` to start one")
    # What this version runs inside a replica group: data parallelism (zero 0) on a dense model
    # trained by AdamW, without checkpoints (docs/operations.md#in-place-healing says what is next).
    layout = [("parallel.tp", p.tp, 1), ("parallel.pp", p.pp, 1), ("parallel.cp", p.cp, 1),
              ("parallel.ep", p.ep, 1), ("parallel.zero", p.zero if p.dp > 1 else 0, 0)]
    for key, value, plain in layout:
        _require(value == plain, f"{key}={value} is not yet available with ft.replicas={f.replicas} (a replica group "
                 f"runs data parallelism at zero 0 in this version); set {key}={plain} or ft.replicas=0")
    features = [("model.moe.n_experts", cfg.model.moe.n_experts, 0), ("model.mtp_depth", cfg.model.mtp_depth, 0),
                ("lora.rank", cfg.lora.rank, 0), ("train.optimizer", t.optimizer, "adamw"),
                ("train.fp8", t.fp8, ""), ("train.qk_clip", t.qk_clip, 0.0), ("train.dtype", t.dtype, "fp32"),
                ("checkpoint.every", cfg.checkpoint.every, 0), ("checkpoint.resume", cfg.checkpoint.resume, "none"),
                ("checkpoint.export_hf", cfg.checkpoint.export_hf, "")]
    for key, value, off in features:
        _require(value == off, f"{key}={value!r} is not yet available with ft.replicas={f.replicas}; set "
                 f"{key}={off!r} or ft.replicas=0")
    if p.dp:  # the batch: every live group must get whole micro-batches for each of its dp ranks
        if not t.micro_batch:
            _require(t.global_batch % (f.replicas * p.dp) == 0, f"train.global_batch={t.global_batch} does not "
                     f"divide over ft.replicas*parallel.dp={f.replicas * p.dp} ranks; choose a multiple of "
                     f"{f.replicas * p.dp} or set train.micro_batch")
        units = t.global_batch // (ft_micro_batch(cfg) * p.dp) if t.global_batch % p.dp == 0 else 0
        _require(units >= f.replicas, f"train.global_batch={t.global_batch} makes {units} micro-batches per "
                 f"data-parallel rank of one group, fewer than ft.replicas={f.replicas}, so a group would have "
                 "nothing to run; lower train.micro_batch or raise train.global_batch")
    if cfg.debug.kill_replica:
        group, _, step = cfg.debug.kill_replica.partition(":")
        _require(group.isdigit() and step.isdigit() and int(group) < f.replicas and 1 <= int(step) <= t.steps,
                 f"debug.kill_replica='{cfg.debug.kill_replica}' must be GROUP:STEP with GROUP below "
                 f"ft.replicas={f.replicas} and STEP from 1 to train.steps={t.steps} (e.g. '1:3')")
