"""Which optimizer state a resume reads: per parameter, the keys of the optimizer the checkpoint
trained it with ('exp_avg/<name>' and 'exp_avg_sq/<name>' for AdamW, 'momentum_buffer/<name>' for
Muon). A parameter whose optimizer this run changes (train.optimizer or train.param_groups' optimizer=)
has no state of its new optimizer in the checkpoint: it starts that state from zero, and AdamW its
step count from zero, as a fresh run would; rank 0 names what changed."""

from __future__ import annotations

from dataclasses import replace

from fivefold.checkpoint.resume_checks import BEFORE_THE_KEY

STATE_KEYS = {"adamw": ("exp_avg", "exp_avg_sq"), "muon": ("momentum_buffer",)}


def saved_train(state: dict, train):
    """This run's [train] section with the optimizer keys the checkpoint trained under."""
    saved = {**BEFORE_THE_KEY, **state.get("train", {})}
    return replace(train, **{key: saved[key] for key in BEFORE_THE_KEY})


def optimizers_by_name(train, cfg_model, lora=None) -> dict[str, str]:
    """Single-device parameter name -> the optimizer that updates it under `train` (`lora`: the
    [lora] section, whose adapters are parameters too)."""
    from fivefold.models.param_settings import settings_by_name
    from fivefold.models import build_meta_model

    return {name: s.optimizer for name, s in settings_by_name(train, build_meta_model(cfg_model, lora)).items()}


def switched(then, now, cfg_model) -> dict[str, tuple[str, str]]:
    """name -> (optimizer in the checkpoint, optimizer now), for the parameters that change it."""
    before, after = optimizers_by_name(then, cfg_model), optimizers_by_name(now, cfg_model)
    return {name: (before[name], after[name]) for name in after if before.get(name, after[name]) != after[name]}


def warning(path, changes: dict[str, tuple[str, str]]) -> str:
    name, (a, b) = next(iter(changes.items()))
    more = f" and {len(changes) - 1} more" if len(changes) > 1 else ""
    return (f"warning: resuming {path}: {name} ({a} -> {b}){more} change optimizer; their optimizer state "
            "starts from zero, as in a fresh run")
