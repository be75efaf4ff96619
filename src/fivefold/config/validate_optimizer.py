"""Checks of the optimizer keys (train.optimizer, train.param_groups, train.qk_clip) before any
process group: malformed groups, QK-clip where it cannot act (Muon on a tensor that is not a matrix
needs the model: fivefold/configure/model_rules.py).
Muon and QK-clip run on every layout AdamW runs on (docs/optimizers.md): no layout is refused."""

from __future__ import annotations

from fivefold.config.errors import ConfigError
from fivefold.config.families import QK_CLIP_FAMILIES
from fivefold.config.param_groups import parse


def runs_muon(optimizer: str, param_groups: str) -> bool:
    """Whether any parameter gets Muon: train.optimizer names it, or a group of train.param_groups
    does. The groups are parsed whatever the optimizer, so malformed ones are refused (one sentence)."""
    groups = parse(param_groups)
    return optimizer == "muon" or any(v == "muon" for g in groups for _, v in g.keys)


def check_optimizer(cfg) -> None:
    """The optimizer keys' rules that need no model (fivefold.configure checks a group that gives
    Muon a vector, which depends on the model's parameters)."""
    t = cfg.train
    if t.qk_clip:
        check_qk_clip(cfg)
    runs_muon(t.optimizer, t.param_groups)  # malformed groups: one sentence


def check_qk_clip(cfg) -> None:
    family = cfg.model.family
    if family not in QK_CLIP_FAMILIES:
        why = ("its q/k RMSNorm undoes a rescaled projection" if family.startswith("qwen3")
               else "latent attention's split query and key are not rescaled yet")
        raise ConfigError(f"train.qk_clip = {cfg.train.qk_clip} does not act on model.family = {family}: {why}; "
                          f"set train.qk_clip = 0, or use a family of {', '.join(QK_CLIP_FAMILIES)}")
    if cfg.lora.rank:
        raise ConfigError(f"train.qk_clip = {cfg.train.qk_clip} rescales the query and key weights, which "
                          "lora.rank freezes; set train.qk_clip = 0 for a LoRA run")
