"""Checks of the optimizer keys (train.optimizer, train.param_groups) before any process group:
malformed groups, Muon on a tensor that is not a matrix, and Muon on a layout it does not reach.

The layout rule (optimizer_layout_problem) is a plain function of numbers, said once: validation
raises its sentence and the planner's search (plan/search.py layout_problem) skips the layouts it
names, so `fivefold plan --train.optimizer muon` never ranks a layout the trainer refuses
(tests/test_refusal_agreement.py checks the two agree)."""

from __future__ import annotations

from functools import lru_cache

from fivefold.config.errors import ConfigError


@lru_cache(maxsize=64)  # the search asks of thousands of layouts, always of the same two strings
def runs_muon(optimizer: str, param_groups: str) -> bool:
    """Whether any parameter gets Muon: train.optimizer names it, or a group of train.param_groups
    does. The groups are parsed whatever the optimizer, so malformed ones are refused (one sentence)
    before any layout rule."""
    from fivefold.config.param_groups import parse

    groups = parse(param_groups)
    return optimizer == "muon" or any(v == "muon" for g in groups for _, v in g.keys)


def muon_unsupported(dtype: str, dp: int, tp: int, pp: int, cp: int, ep: int, dp_shard: int) -> str | None:
    """What of the layout (the [parallel] degrees; `dtype`: train.dtype) Muon does not reach yet,
    or None. Reached, one dimension at a time: dp with ZeRO 0/1/2 (parallel/data/muon_step.py) and 3
    (FSDP2, parallel/muon_dtensor.py), fp32 or bf16, with ep borrowing dp (whole experts); cp, the
    same way (its ranks share the dp ranks' buckets and shards); pp, any schedule (each stage's
    matrices whole); tp in fp32 (parallel/muon_dtensor.py)."""
    degrees = {"dp": dp, "tp": tp, "pp": pp, "cp": cp}
    used = [f"parallel.{name}={n}" for name, n in degrees.items() if n > 1]
    if len(used) > 1:
        return f"{used[0]} with {used[1]} (Muon is tested one dimension at a time)"
    if tp > 1 and dtype != "fp32":
        return f"parallel.tp={tp} under train.dtype = {dtype} (tensor-parallel matrices in fp32 master buckets)"
    if ep > 1 and tp > 1:
        return f"parallel.ep={ep} with parallel.tp={tp} (experts on tensor-parallel ranks)"
    if dp_shard and dp_shard < dp:
        return f"parallel.dp_shard={dp_shard} (HSDP)"
    return None


def optimizer_layout_problem(optimizer: str, param_groups: str, dtype: str, dp: int, tp: int, pp: int,
                             cp: int, ep: int, dp_shard: int) -> str | None:
    """The sentence refusing this layout for the optimizers train.optimizer and train.param_groups
    name, or None. AdamW runs on every layout. Muon's verdict does not depend on the ZeRO stage or
    recomputation, which is what lets the search ask once per group of layouts differing only in
    those (plan/search.py)."""
    if not runs_muon(optimizer, param_groups):
        return None
    missing = muon_unsupported(dtype, dp, tp, pp, cp, ep, dp_shard)
    if missing is None:
        return None
    return (f"train.optimizer = muon does not run on {missing} yet, only on one of dp (zero 0 to 3, with "
            "ep), pp, cp, or tp in fp32; use train.optimizer = adamw for this layout, or train Muon on "
            "one of those")


def check_optimizer(cfg) -> None:
    from fivefold.config.param_groups import settings_by_name

    t, p = cfg.train, cfg.parallel
    if not runs_muon(t.optimizer, t.param_groups):
        return
    problem = optimizer_layout_problem(t.optimizer, t.param_groups, t.dtype, p.dp, p.tp, p.pp, p.cp, p.ep,
                                       p.dp_shard)
    if problem:
        raise ConfigError(problem)
    from fivefold.models import build_meta_model

    settings_by_name(t, build_meta_model(cfg.model))  # one sentence if a group gives Muon a vector
