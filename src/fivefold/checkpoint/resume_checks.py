"""What a resume compares between a checkpoint and this run: the model must be the same one (its
tensors could match by accident), and changed training keys are named (the new values win)."""

from __future__ import annotations

from pathlib import Path

from fivefold.config import Config, ConfigError

# [model] keys that change neither a tensor's shape nor the model's math are not compared on
# resume: `preset` and `init_from` only say where the other keys came from, `max_seq_len` only
# bounds train.seq_len, and the MoE balancing rates are training hyperparameters (like train.*:
# the new value wins, with the warning).
NOT_COMPARED = ("preset", "init_from", "max_seq_len")
TRAINING_KEYS = ("moe.aux_loss_coeff", "moe.bias_update_rate", "mtp_loss_weight")
# [train] keys added after checkpoints were first written, with the value a checkpoint without them
# trained under: comparing with it names a changed default (e.g. no decay on norms, biases and
# embeddings) instead of resuming under it silently.
BEFORE_THE_KEY = {"param_groups": "", "optimizer": "adamw"}


def _flat(section: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in section.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _changed(saved: dict, now: dict, section: str) -> list[str]:
    """`section.key saved -> now` for each key both know and that differs (a key an older
    checkpoint did not record is not compared)."""
    saved, now = _flat(saved), _flat(now)
    return [f"{section}.{key} {saved[key]!r} -> {now[key]!r}" for key in now
            if key in saved and saved[key] != now[key]]


def check_model(path: Path, state: dict, cfg: Config) -> None:
    """Refuse a checkpoint of another model, even one whose tensors happen to have the same shapes."""
    saved = {k: v for k, v in _flat(state.get("model", {})).items()
             if k not in NOT_COMPARED and k not in TRAINING_KEYS}
    differing = _changed(saved, cfg.to_dict()["model"], "model")
    if differing:
        raise ConfigError(f"checkpoint {path} is of another model ({', '.join(differing)}, saved -> this run); "
                          f"resume it with its own [model] settings (its config.toml) or start this model "
                          f"without checkpoint.resume")


def changed_training_keys(state: dict, cfg: Config) -> list[str]:
    """Training keys that differ from the checkpoint's: on resume the new values win."""
    model = _flat(state.get("model", {}))
    saved_training = {k: model[k] for k in TRAINING_KEYS if k in model}
    now = _flat(cfg.to_dict()["model"])
    saved_train = {**BEFORE_THE_KEY, **state.get("train", {})}
    return (_changed(saved_train, cfg.to_dict()["train"], "train")
            + _changed(saved_training, {k: now[k] for k in TRAINING_KEYS}, "model"))


# [train] keys the saved data position depends on: step k's batch is windows of seq_len tokens drawn
# global_batch at a time in the seed's order, so the position means nothing under other values.
DATA_POSITION_KEYS = ("seq_len", "global_batch", "seed")


def check_data_position(path: Path, state: dict, cfg: Config) -> None:
    """Refuse, naming the key, a resume whose data position cannot carry over."""
    saved = state.get("train", {})
    now = cfg.to_dict()["train"]
    for key in DATA_POSITION_KEYS:
        if key in saved and saved[key] != now[key]:
            raise ConfigError(f"checkpoint {path} trained with train.{key} = {saved[key]!r} and this run has "
                              f"train.{key} = {now[key]!r}: its data position (step {state.get('step')}) counts "
                              f"batches under the old value and cannot continue under the new one; resume with "
                              f"train.{key} = {saved[key]!r}, or start a new run in another log.dir")
