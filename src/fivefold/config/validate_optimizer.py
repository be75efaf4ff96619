"""Checks of the optimizer keys (train.optimizer, train.param_groups) before any process group:
malformed groups, Muon on a tensor that is not a matrix, and Muon on a layout it does not reach."""

from __future__ import annotations

from fivefold.config.errors import ConfigError


def muon_unsupported(p) -> str | None:
    """What of the layout `p` (the [parallel] section) Muon does not reach yet, or None.
    Reached: data parallelism with ZeRO 0/1/2 (parallel/data/muon_step.py), fp32 or bf16."""
    if p.tp > 1:
        return f"parallel.tp={p.tp} (tensor-parallel matrices)"
    if p.pp > 1:
        return f"parallel.pp={p.pp}"
    if p.cp > 1:
        return f"parallel.cp={p.cp}"
    if p.ep > 1:
        return f"parallel.ep={p.ep}"
    if p.zero == 3 and p.dp > 1:
        return "parallel.zero=3 (FSDP2 shards)"
    if p.dp_shard and p.dp_shard < p.dp:
        return f"parallel.dp_shard={p.dp_shard} (HSDP)"
    return None


def check_optimizer(cfg) -> None:
    from fivefold.config.param_groups import parse, settings_by_name

    t = cfg.train
    groups = parse(t.param_groups)
    muon = t.optimizer == "muon" or any(v == "muon" for g in groups for _, v in g.keys)
    if not muon:
        return
    missing = muon_unsupported(cfg.parallel)
    if missing:
        raise ConfigError(f"train.optimizer = muon does not run on {missing} yet, only on data parallelism "
                          "with parallel.zero 0, 1 or 2; use train.optimizer = adamw for this layout, or "
                          "train Muon with dp and zero 0/1/2")
    from fivefold.models import build_meta_model

    settings_by_name(t, build_meta_model(cfg.model))  # one sentence if a group gives Muon a vector
