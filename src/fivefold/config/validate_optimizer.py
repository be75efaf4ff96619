"""Checks of the optimizer keys (train.optimizer, train.param_groups) before any process group:
malformed groups, Muon on a tensor that is not a matrix, and Muon on a layout it does not reach."""

from __future__ import annotations

from fivefold.config.errors import ConfigError


def muon_unsupported(p, dtype: str = "fp32") -> str | None:
    """What of the layout `p` (the [parallel] section; `dtype`: train.dtype) Muon does not reach
    yet, or None. Reached, one dimension at a time: dp with ZeRO 0/1/2 (parallel/data/muon_step.py)
    and 3 (FSDP2, parallel/muon_dtensor.py), fp32 or bf16, with ep borrowing dp (whole experts);
    cp, the same way (its ranks share the dp ranks' buckets and shards); pp, any schedule (each
    stage's matrices whole); tp in fp32 (parallel/muon_dtensor.py)."""
    used = [f"parallel.{name}={getattr(p, name)}" for name in ("dp", "tp", "pp", "cp") if getattr(p, name) > 1]
    if len(used) > 1:
        return f"{used[0]} with {used[1]} (Muon is tested one dimension at a time)"
    if p.tp > 1 and dtype != "fp32":
        return f"parallel.tp={p.tp} under train.dtype = {dtype} (tensor-parallel matrices in fp32 master buckets)"
    if p.ep > 1 and p.tp > 1:
        return f"parallel.ep={p.ep} with parallel.tp={p.tp} (experts on tensor-parallel ranks)"
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
    missing = muon_unsupported(cfg.parallel, t.dtype)
    if missing:
        raise ConfigError(f"train.optimizer = muon does not run on {missing} yet, only on one of dp (zero 0 to "
                          "3, with ep), pp, cp, or tp in fp32; use train.optimizer = adamw for this layout, or "
                          "train Muon on one of those")
    from fivefold.models import build_meta_model

    settings_by_name(t, build_meta_model(cfg.model))  # one sentence if a group gives Muon a vector
