"""Checks of the optimizer keys (train.optimizer, train.param_groups) before any process group:
malformed groups and Muon on a tensor that is not a matrix. Muon runs on every layout AdamW runs
on (docs/optimizers.md), so no layout is refused for it."""

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
    if not runs_muon(t.optimizer, t.param_groups):
        return
    from fivefold.models import build_meta_model

    settings_by_name(t, build_meta_model(cfg.model))  # one sentence if a group gives Muon a vector
