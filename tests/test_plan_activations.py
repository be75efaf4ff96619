"""Issue 9's check of activation memory against our own runs: the planner's predicted
activation bytes per rank ('fivefold' recipe, plan/memory.py) within 10% of what one
micro-batch's forward really keeps for backward (train/activation_probe.py), for fp32 and bf16
autocast, tensor (with and without sequence), context and expert parallelism, dense and MoE
blocks, and each recomputation mode; for the llama-style tiny model and (issue 17) the tiny
qwen3 and qwen3_moe presets, whose per-head q/k norms and queries wider than the residual stream
(head_dim 48 x 4 heads = 192 > dim 128) the recipe must count; (issue 18) tiny-deepseek-v3, whose
latent attention keeps its latents and their norms whole over tp and on the gathered sequence,
q/k of 16+8 per head and v of 16 (which sends CPU attention down SDPA's math path: fp32 scores).

A sequence of 256 tokens makes activations dominate the small fixed tensors."""

import pytest
import torch

from fivefold.presets import PRESETS
from layouts import BASE, tiny_config
from ranks import run_on_ranks

SHAPE = {"train": {"seq_len": 256, "micro_batch": 2, "global_batch": 2}}


def _with(parallel: dict, **train) -> dict:
    return {"parallel": parallel, "train": {**SHAPE["train"], **train}}


def _preset(name: str) -> dict:
    """A preset whole: the BASE shape tiny_config starts from would override its own."""
    return {"model": {"preset": name, **{key: PRESETS[name][key] for key in BASE["model"]}}}


MOE = {"model": {"moe": {"n_experts": 4, "top_k": 2, "expert_ffn_dim": 64}}}
QWEN3 = {"qwen3": _preset("tiny-qwen3"), "qwen3-moe": _preset("tiny-qwen3-moe")}
FAMILIES = {**QWEN3, "deepseek-v3": _preset("tiny-deepseek-v3")}
ONE_RANK = {f"{dtype} {mode}": _with({}, recompute=mode, dtype=dtype)
            for dtype in ("fp32", "bf16") for mode in ("none", "selective", "full")}
ONE_RANK.update({f"moe {dtype} {mode}": {**MOE, **_with({}, recompute=mode, dtype=dtype)}
                 for dtype in ("fp32", "bf16") for mode in ("none", "selective")})
# The two-rank layouts every model is measured under (the MoE ones add their own below).
LAYOUTS_2 = {
    **{f"tp2 {mode}": _with({"tp": 2}, recompute=mode) for mode in ("none", "selective", "full")},
    "tp2 no-sp none": _with({"tp": 2, "sp": False}),
    "tp2 bf16 none": _with({"tp": 2}, dtype="bf16"),
    "tp2 bf16 selective": _with({"tp": 2}, dtype="bf16", recompute="selective"),
    "cp2 ring": _with({"cp": 2}),
    "cp2 ulysses": _with({"cp": 2, "cp_method": "ulysses"}),
    "cp2 ring selective": _with({"cp": 2}, recompute="selective"),
}
TWO_RANKS = {
    **LAYOUTS_2,
    "moe dp2 ep2": {**MOE, **_with({"dp": 2, "ep": 2}, global_batch=4)},
    "moe tp2": {**MOE, **_with({"tp": 2})},
}
for family, model in FAMILIES.items():
    ONE_RANK.update({f"{family} {dtype} {mode}": {**model, **_with({}, recompute=mode, dtype=dtype)}
                     for dtype in ("fp32", "bf16") for mode in ("none", "selective", "full")})
    TWO_RANKS.update({f"{family} {label}": {**model, **layout} for label, layout in LAYOUTS_2.items()})
for family in ("qwen3-moe", "deepseek-v3"):
    TWO_RANKS[f"{family} dp2 ep2"] = {**FAMILIES[family], **_with({"dp": 2, "ep": 2}, global_batch=4)}

# The same cases with wider heads (head_dim 64: q 256, kv 128): what the q-width terms add is a few
# percent of the whole, so test_q_width_terms compares the change with the predicted change.
WIDER = {"qwen3 fp32 none": ONE_RANK, "qwen3 bf16 selective": ONE_RANK, "qwen3 cp2 ring": TWO_RANKS}
for label, cases in WIDER.items():
    case = cases[label]
    cases[f"{label} head_dim 64"] = {**case, "model": {**case["model"], "head_dim": 64}}

# And tiny-deepseek-v3 with one MLA width changed at a time: test_mla_width_terms.
MLA_WIDER = {"latents 64": {"q_lora_rank": 64, "kv_lora_rank": 64}, "v_head_dim 32": {"v_head_dim": 32},
             "rope 16": {"qk_rope_head_dim": 16}}
MLA_CASES = {"deepseek-v3 fp32 none": ONE_RANK, "deepseek-v3 bf16 none": ONE_RANK,
             "deepseek-v3 bf16 selective": ONE_RANK, "deepseek-v3 tp2 none": TWO_RANKS,
             "deepseek-v3 tp2 selective": TWO_RANKS}
for label, cases in MLA_CASES.items():
    case = cases[label]
    for change, keys in MLA_WIDER.items():
        cases[f"{label} {change}"] = {**case, "model": {**case["model"], **keys}}


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
    for model in ("", "qwen3 ", "qwen3-moe ", "deepseek-v3 "):
        for dtype in ("fp32", "bf16"):
            assert (measured[f"{model}{dtype} none"] > measured[f"{model}{dtype} selective"]
                    > measured[f"{model}{dtype} full"])
        assert measured[f"{model}tp2 none"] < measured[f"{model}tp2 no-sp none"]  # sp splits the norms


def test_qwen3_cases_have_queries_wider_than_the_stream():
    # What makes them worth measuring: a recipe that took q = dim would be off by 20% and more.
    for model in QWEN3.values():
        m = tiny_config(model).model
        assert m.n_heads * m.head_dim > m.dim and m.family.startswith("qwen3")


@pytest.mark.parametrize("label", WIDER)
def test_q_width_terms(measured, label):
    """From head_dim 48 to 64 every query-wide tensor (q, the attention output, its copy under cp,
    the q/k norms' input and x·rstd) grows: the bytes added match the recipe's."""
    cases = {**ONE_RANK, **TWO_RANKS}
    wider = f"{label} head_dim 64"
    want = measured[wider] - measured[label]
    got = _predicted(cases[wider]) - _predicted(cases[label])
    assert want > 0 and abs(got - want) <= 0.10 * want, \
        f"{label}: predicted +{got:,.0f} B, measured +{want:,} B"


@pytest.mark.parametrize("change", MLA_WIDER)
@pytest.mark.parametrize("label", MLA_CASES)
def test_mla_width_terms(measured, label, change):
    """Wider latents (each latent norm's fp32 input, x·rstd and output; under selective the
    down-projections' outputs; the same on every tp rank: they run whole, on the gathered
    sequence), a wider v (its fp32 copy on SDPA's math path, the output's copy; kv_b's output
    under selective), more RoPE channels (q and k; under selective in q_b's output and once in
    kv_a's, not per head): the bytes added match the recipe's."""
    cases = {**ONE_RANK, **TWO_RANKS}
    wider = f"{label} {change}"
    want = measured[wider] - measured[label]
    got = _predicted(cases[wider]) - _predicted(cases[label])
    assert want > 0 and abs(got - want) <= 0.10 * want, \
        f"{wider}: predicted +{got:,.0f} B, measured +{want:,} B"
