"""A Llama block keeps for backward what its backward reads, at the count docs/models.md derives
(plan/memory/activations.py fivefold_layer_bytes): measured per token and layer as the difference between a
2-layer and a 1-layer model's forward (train/activation_probe.py), within 5%, in fp32 and bf16,
without and with tp2 + sequence parallelism."""

import pytest

from layouts import tiny_config
from ranks import run_on_ranks
from test_plan_activations import _measure, _with

SHAPE = {"dim": 128, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 352}
CASES = {"fp32": ({}, "fp32"), "bf16": ({}, "bf16"), "tp2 sp bf16": ({"tp": 2}, "bf16")}


def _layouts(parallel: dict, dtype: str) -> dict:
    return {layers: {**_with(parallel, dtype=dtype), "model": {**SHAPE, "n_layers": layers}} for layers in (1, 2)}


def _per_layer(parallel: dict, dtype: str, measured: dict) -> tuple[float, float]:
    from fivefold.plan.memory.activations import fivefold_layer_bytes
    from fivefold.plan.layout import layout_from_config
    from fivefold.plan.workload import workload_from_config

    layouts = _layouts(parallel, dtype)
    cfg = tiny_config(layouts[1])
    workload, layout = workload_from_config(cfg), layout_from_config(cfg)
    tokens = cfg.train.global_batch * cfg.train.seq_len  # one micro-batch: the whole batch on one dp rank
    got = (measured[2] - measured[1]) / tokens
    want = fivefold_layer_bytes(workload.stats, 0, layout, cfg.train.seq_len, "none", workload.precision, True)
    return got, want


@pytest.mark.parametrize("label", list(CASES))
def test_llama_block_keeps_the_documented_count(label):
    parallel, dtype = CASES[label]
    layouts = _layouts(parallel, dtype)
    if parallel:
        per_rank = run_on_ranks(2, _measure, layouts)
        measured = {layers: max(rank[layers] for rank in per_rank) for layers in layouts}
    else:
        measured = _measure(layouts)
    got, want = _per_layer(parallel, dtype, measured)
    assert abs(got - want) <= 0.05 * want, f"{label}: a block keeps {got:,.0f} B per token, the count says {want:,.0f}"
