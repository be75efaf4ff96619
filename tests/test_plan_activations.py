"""Issue 9's check of activation memory against our own runs: the planner's predicted
activation bytes per rank ('fivefold' recipe, plan/memory.py) within 10% of what one
micro-batch's forward really keeps for backward (train/activation_probe.py), for fp32 and bf16
autocast, tensor (with and without sequence), context and expert parallelism, dense and MoE
blocks, and each recomputation mode.

A sequence of 256 tokens makes activations dominate the small fixed tensors (RoPE tables)."""

import pytest
import torch

from layouts import tiny_config
from ranks import run_on_ranks

SHAPE = {"train": {"seq_len": 256, "micro_batch": 2, "global_batch": 2}}


def _with(parallel: dict, **train) -> dict:
    return {"parallel": parallel, "train": {**SHAPE["train"], **train}}


MOE = {"model": {"moe": {"n_experts": 4, "top_k": 2, "expert_ffn_dim": 64}}}
ONE_RANK = {f"{dtype} {mode}": _with({}, recompute=mode, dtype=dtype)
            for dtype in ("fp32", "bf16") for mode in ("none", "selective", "full")}
ONE_RANK.update({f"moe {dtype} {mode}": {**MOE, **_with({}, recompute=mode, dtype=dtype)}
                 for dtype in ("fp32", "bf16") for mode in ("none", "selective")})
TWO_RANKS = {f"tp2 {mode}": _with({"tp": 2}, recompute=mode) for mode in ("none", "selective", "full")}
TWO_RANKS.update({
    "tp2 no-sp none": _with({"tp": 2, "sp": False}),
    "tp2 bf16 none": _with({"tp": 2}, dtype="bf16"),
    "tp2 bf16 selective": _with({"tp": 2}, dtype="bf16", recompute="selective"),
    "cp2 ring": _with({"cp": 2}),
    "cp2 ulysses": _with({"cp": 2, "cp_method": "ulysses"}),
    "cp2 ring selective": _with({"cp": 2}, recompute="selective"),
    "moe dp2 ep2": {**MOE, **_with({"dp": 2, "ep": 2}, global_batch=4)},
    "moe tp2": {**MOE, **_with({"tp": 2})},
})


def _measure(layouts: dict) -> dict:
    from fivefold.train.activation_probe import forward_kept_bytes
    from fivefold.train.trainer import autocast, setup

    out = {}
    for label, overrides in layouts.items():
        cfg = tiny_config(overrides)
        rt, par = setup(cfg)
        batch = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.train.seq_len + 1),
                              generator=torch.Generator().manual_seed(0))
        out[label] = forward_kept_bytes(par, batch, lambda: autocast(cfg, rt.device))
    return out


def _predicted(overrides: dict) -> float:
    from fivefold.plan import plan_layout
    from fivefold.plan.layout import layout_from_config

    cfg = tiny_config(overrides)
    return plan_layout(cfg, layout_from_config(cfg), gpu="cpu").memory.activations


@pytest.fixture(scope="module")
def measured():
    one = _measure(ONE_RANK)
    per_rank = run_on_ranks(2, _measure, TWO_RANKS)
    two = {label: max(rank[label] for rank in per_rank) for label in TWO_RANKS}  # the worst rank
    return {**one, **two}


@pytest.mark.parametrize("label", [*ONE_RANK, *TWO_RANKS])
def test_predicted_activations_match_what_the_forward_keeps(measured, label):
    want = measured[label]
    got = _predicted({**ONE_RANK, **TWO_RANKS}[label])
    assert abs(got - want) <= 0.10 * want, f"{label}: predicted {got:,.0f} B, measured {want:,} B"


def test_measurement_sees_recomputation(measured):
    # The probe is a measurement, not the formula: each mode keeps strictly less.
    for dtype in ("fp32", "bf16"):
        assert measured[f"{dtype} none"] > measured[f"{dtype} selective"] > measured[f"{dtype} full"]
    assert measured["tp2 none"] < measured["tp2 no-sp none"]  # sequence parallelism splits the norms
