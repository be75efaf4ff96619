"""Checks of the optimizer keys (train.optimizer, train.param_groups, train.qk_clip) before any
process group: malformed groups, Muon on a tensor that is not a matrix, QK-clip where it cannot act.
Muon and QK-clip run on every layout AdamW runs on (docs/optimizers.md): no layout is refused."""

from __future__ import annotations


def runs_muon(optimizer: str, param_groups: str) -> bool:
    """Whether any parameter gets Muon: train.optimizer names it, or a group of train.param_groups
    does. The groups are parsed whatever the optimizer, so malformed ones are refused (one sentence)."""
    from fivefold.config.param_groups import parse

    groups = parse(param_groups)
    return optimizer == "muon" or any(v == "muon" for g in groups for _, v in g.keys)


def check_optimizer(cfg) -> None:
    from fivefold.config.param_groups import settings_by_name

    t = cfg.train
    if t.qk_clip:
        check_qk_clip(cfg)
    if not runs_muon(t.optimizer, t.param_groups):
        return
    # The groups' verdict depends on the model and the optimizer keys only, not on the layout:
    # the planner's search validates many layouts of one model (a meta model of qwen3-30b-a3b: ~7 s).
    key = (repr(cfg.model), t.optimizer, t.param_groups, t.weight_decay)
    if key in _GROUPS_CHECKED:
        return
    from fivefold.models import build_meta_model

    settings_by_name(t, build_meta_model(cfg.model))  # one sentence if a group gives Muon a vector
    _GROUPS_CHECKED.add(key)


_GROUPS_CHECKED: set[tuple] = set()  # (model, optimizer keys) whose groups passed check_optimizer


def check_qk_clip(cfg) -> None:
    from fivefold.config.errors import ConfigError
    from fivefold.config.families import QK_CLIP_FAMILIES

    family = cfg.model.family
    if family not in QK_CLIP_FAMILIES:
        why = ("its q/k RMSNorm undoes a rescaled projection" if family.startswith("qwen3")
               else "latent attention's split query and key are not rescaled yet")
        raise ConfigError(f"train.qk_clip = {cfg.train.qk_clip} does not act on model.family = {family}: {why}; "
                          f"set train.qk_clip = 0, or use a family of {', '.join(QK_CLIP_FAMILIES)}")
    if cfg.lora.rank:
        raise ConfigError(f"train.qk_clip = {cfg.train.qk_clip} rescales the query and key weights, which "
                          "lora.rank freezes; set train.qk_clip = 0 for a LoRA run")
