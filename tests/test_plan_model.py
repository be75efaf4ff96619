"""Planner arithmetic: parameter counts, FLOPs, memory per ZeRO stage, activations, pipeline
schedules and communication volumes, checked against published numbers and hand formulas."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fivefold.configure import load_config
from fivefold.plan import comm
from fivefold.plan.estimate import estimate
from fivefold.plan.hardware import hardware_for
from fivefold.plan.speed.frameworks import DEFAULT_RUNTIME, NANOTRON_RUNTIME
from fivefold.plan.layout import Layout, parse_layout
from fivefold.plan.memory.activations import fivefold_layer_bytes, layer_activation_elements
from fivefold.plan.memory.peak import model_state_bytes, rank_memory, rank_param_counts, worst_rank_memory
from fivefold.plan.model_stats import model_stats
from fivefold.plan.pipeline.stage_split import balanced_layer_counts
from fivefold.plan.pipeline.schedule import (bubble_fraction, in_flight_chunks,
                                    pipeline_ranks)
from fivefold.plan.workload import PRECISIONS, workload_from_config

H100 = hardware_for("h100")


def cfg_for(preset: str, *extra: str):
    return load_config(None, ["--model.preset", preset, "--train.dtype", "bf16", *extra])


def stats_for(preset: str):
    return model_stats(cfg_for(preset).model)


# ----------------------------------------------------------------------------- model statistics

@pytest.mark.parametrize("preset, params", [
    ("llama3-1b", 1.236e9), ("llama3-3b", 3.213e9), ("llama3-8b", 8.030e9),
    ("llama3-70b", 70.55e9), ("llama3-405b", 405.85e9)])
def test_llama_parameter_counts_match_published(preset, params):
    assert stats_for(preset).total_params == pytest.approx(params, rel=2e-3)


def test_llama3_8b_exact_breakdown():
    s = stats_for("llama3-8b")
    assert s.embedding_params == 2 * 128256 * 4096  # untied: embedding + output
    assert s.layer_params(0) == 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert s.total_params == 8_030_261_248


def test_tied_embedding_counted_once():
    s = stats_for("llama3-1b")
    assert s.embedding_params == 128256 * 2048


def test_moe_total_versus_active():
    s = stats_for("mixtral-8x7b")
    assert s.total_params == pytest.approx(46.70e9, rel=2e-3)
    assert s.active_params == pytest.approx(12.88e9, rel=2e-3)
    ds = stats_for("deepseek-v3-style")
    assert ds.moe_layers[0] == 3 and ds.n_moe_layers == 58  # first_dense = 3


def test_flops_per_token_is_6n_plus_attention():
    s = stats_for("llama3-8b")
    assert s.flops_per_token(4096) == 6 * s.total_params + 12 * 32 * 4096 * 4096
    moe = stats_for("mixtral-8x7b")
    assert moe.flops_per_token(4096) == 6 * moe.active_params + 12 * 32 * 4096 * 4096


# ------------------------------------------------------------------------------------- memory

def test_model_state_bytes_by_zero_stage():
    w = workload_from_config(cfg_for("llama3-8b"))
    n = 1e9
    got = {z: model_state_bytes(w, Layout(dp=8, zero=z), n, 0.0) for z in range(4)}
    # fivefold bf16 (docs/precision.md): bf16 weights 2, fp32 gradient buffer 4, fp32 master 4 +
    # Adam 8 with the optimizer; ZeRO-3's shards are the fp32 masters.
    assert got[0] == {"params": 2 * n, "grads": 4 * n, "optimizer": 12 * n}
    # ZeRO-1: Megatron's distributed optimizer, the chunk's gradient a view of the buffer
    assert got[1] == {"params": 2 * n, "grads": 4 * n, "optimizer": 12 * n / 8}
    assert got[2] == {"params": 2 * n, "grads": 4 * n / 8, "optimizer": 12 * n / 8}
    assert got[3] == {"params": 4 * n / 8, "grads": 4 * n / 8, "optimizer": 8 * n / 8}
    fp32 = dataclasses.replace(w, precision=PRECISIONS["fp32"])
    # fp32: ZeRO-1/2 add a 4-byte master chunk, ZeRO-1 its reduced gradient chunk beside the whole gradients
    assert model_state_bytes(fp32, Layout(dp=8, zero=1), n, 0.0) == {"params": 4 * n, "grads": 4 * n + 4 * n / 8,
                                                                     "optimizer": 12 * n / 8}
    hsdp = model_state_bytes(w, Layout(dp=8, zero=3, dp_shard=4), n, 0.0)
    assert hsdp["params"] == 4 * n / 4


def test_mixed_precision_with_fp32_accumulation_is_20_bytes_per_param():
    w = dataclasses.replace(workload_from_config(cfg_for("llama3-8b")),
                            precision=PRECISIONS["bf16_fp32_accum"])
    state = model_state_bytes(w, Layout(dp=1), 1.0, 0.0)
    assert sum(state.values()) == 20
    assert model_state_bytes(w, Layout(dp=4, zero=1), 1.0, 0.0)["optimizer"] == 12 / 4


def test_experts_split_over_ep_ranks():
    s = stats_for("mixtral-8x7b")
    whole = rank_param_counts(s, Layout(dp=8, ep=1), pipeline_ranks(s, Layout(), 4096)[0])
    split = rank_param_counts(s, Layout(dp=8, ep=8), pipeline_ranks(s, Layout(), 4096)[0])
    assert whole[0] == split[0]
    assert split[1] == pytest.approx(whole[1] / 8)
    assert whole[1] == s.expert_params_total


def test_activation_elements_per_layer():
    s = stats_for("llama3-8b")
    h, kv, f = 4096, 1024, 14336
    none = layer_activation_elements(s, 0, Layout(), 4096, "none", True)
    assert none == 4 * h + (5 * h + 2 * kv) + 2 * 32 + 4 * f
    # tensor + sequence parallelism split every term across t
    tp4 = layer_activation_elements(s, 0, Layout(tp=4), 4096, "none", True)
    assert tp4 == pytest.approx(none / 4)
    # without sequence parallelism the norm inputs/outputs stay whole (Korthikanti's 10sbh)
    no_sp = layer_activation_elements(s, 0, Layout(tp=4, sp=False), 4096, "none", True)
    assert no_sp == pytest.approx(tp4 + 4 * h * (1 - 1 / 4))
    assert layer_activation_elements(s, 0, Layout(), 4096, "full", True) == h
    selective = layer_activation_elements(s, 0, Layout(), 4096, "selective", True)
    assert selective == none - 2 * h - f
    # an unfused attention keeps the softmax: a x s per token
    assert layer_activation_elements(s, 0, Layout(), 4096, "none", False) == none + 32 * 4096


def test_one_f_one_b_first_rank_holds_p_microbatches_and_worst_rank_is_reported():
    w = workload_from_config(cfg_for("llama3-8b", "--train.global_batch", "64",
                                     "--train.seq_len", "4096"))
    layout = Layout(dp=1, pp=4, mbs=1, pp_schedule="1f1b")
    ranks = pipeline_ranks(w.stats, layout, w.seq_len)
    assert [in_flight_chunks(layout, r, 64) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_chunks(dataclasses.replace(layout, pp_schedule="gpipe"), 0, 64) == 64
    inter = dataclasses.replace(layout, pp_schedule="interleaved_1f1b", pp_virtual=2)
    assert in_flight_chunks(inter, 0, 64) == pytest.approx(4 * (1 + 3 / 8))
    mems = [rank_memory(w, layout, H100, DEFAULT_RUNTIME, pr, r) for r, pr in enumerate(ranks)]
    worst = worst_rank_memory(w, layout, H100, DEFAULT_RUNTIME)
    assert worst.total == max(m.total for m in mems)
    assert ranks[0].has_embedding and ranks[-1].has_output
    assert sum(len(r.layers) for r in ranks) == 32


def test_last_rank_holds_the_logits():
    """'nanotron' recipe (the Playbook's runs): bf16 logits, fp32 softmax copy and gradient."""
    w = workload_from_config(cfg_for("llama3-8b", "--train.seq_len", "4096"))
    layout = Layout(pp=2, mbs=1, pp_layers="16,16")
    first, last = pipeline_ranks(w.stats, layout, 4096)
    m_first = rank_memory(w, layout, H100, NANOTRON_RUNTIME, first, 0)
    m_last = rank_memory(w, layout, H100, NANOTRON_RUNTIME, last, 1)
    logits = 4096 * 128256 * NANOTRON_RUNTIME.logits_bytes_per_element
    per_layer = layer_activation_elements(w.stats, 0, layout, 4096, "none", True) * 4096 * 2
    assert m_first.activations == pytest.approx(2 * 16 * per_layer)  # 2 micro-batches in flight
    final_norm = 2 * 4096 * 4096 * 2  # its input and output, one micro-batch
    assert m_last.activations == pytest.approx(16 * per_layer + logits + final_norm)


def test_fivefold_recipe_last_rank_keeps_no_logits():
    w = workload_from_config(cfg_for("llama3-8b", "--train.seq_len", "4096"))  # bf16 weights
    layout = Layout(pp=2, mbs=1, pp_layers="16,16")
    first, last = pipeline_ranks(w.stats, layout, 4096)
    m_first = rank_memory(w, layout, H100, DEFAULT_RUNTIME, first, 0)
    m_last = rank_memory(w, layout, H100, DEFAULT_RUNTIME, last, 1)
    h, kv, f = 4096, 1024, 14336
    # Per token: two norms (bf16 input, fp32 rstd, bf16 output), attention (q, k, v, output;
    # fp32 logsumexp), SwiGLU (gate, up and their product).
    layer = 2 * (h * 2 + 4 + h * 2) + (2 * h + 2 * kv) * 2 + 32 * 4 + 3 * f * 2
    assert fivefold_layer_bytes(w.stats, 0, layout, 4096, "none", w.precision, True) == layer
    rope = 2 * 4 * 4096 * 128  # per micro-batch: fp32 cos and sin, seq x head_dim
    # + the stage outputs 1f1b still holds for sending (three bf16 outputs, parallel/pipeline/stages.py)
    assert m_first.activations == pytest.approx(2 * (16 * layer * 4096 + rope) + 3 * 4096 * 4096 * 2)
    final_norm = (h * 2 + 4 + h * 2) * 4096
    # The output layer fused with its loss (models/loss/linear_cross_entropy.py) keeps its input (in
    # final_norm), an fp32 log-sum-exp and the int64 target per token: no logits; its backward
    # sums the weight's gradient in fp32 (vocab x dim) beside the last rank's working memory.
    loss = 4096 * (4 + 8)
    assert m_last.activations == pytest.approx(16 * layer * 4096 + rope + final_norm + loss)
    assert m_last.other - m_first.other == pytest.approx(4 * 128256 * h, rel=0.05)


# ---------------------------------------------------------------------------------- schedules

def test_bubble_fractions():
    m = 32
    def bubble(**kw):
        return bubble_fraction(Layout(pp=4, **kw), m)
    assert bubble(pp_schedule="1f1b") == pytest.approx(3 / 35)
    assert bubble(pp_schedule="gpipe") == pytest.approx(3 / 35)
    assert bubble(pp_schedule="interleaved_1f1b", pp_virtual=2) == pytest.approx(1.5 / 33.5)
    assert bubble(pp_schedule="zb") == pytest.approx(1 / 33)
    assert bubble(pp_schedule="zbv") == 0.0
    assert bubble_fraction(Layout(pp=1), m) == 0.0


def test_balanced_split_gives_the_output_rank_fewer_layers():
    sizes = balanced_layer_counts([1.0] * 16, 3.2, 8)
    assert sum(sizes) == 16 and min(sizes) >= 1 and len(sizes) == 8
    assert sizes[-1] == 1  # the output projection is worth ~3 layers
    assert max(sizes[:-1]) == 3  # the cheapest most-expensive stage: 16 layers, 4.2 on the last


def test_explicit_pp_layers_must_add_up():
    s = stats_for("llama3-8b")
    with pytest.raises(ValueError, match="adding up to model.n_layers=32"):
        pipeline_ranks(s, Layout(pp=2, pp_layers="10,10"), 4096)


# ------------------------------------------------------------------------------ communication

def test_collective_volumes():
    layout = Layout(tp=4)
    # TP moves b s h (t-1)/t elements per collective (8 per layer per micro-batch)
    assert comm.tp_bytes_per_collective(layout, 4096, 4096, 2) == 4096 * 4096 * 3 / 4 * 2
    assert comm.pp_bytes_per_microbatch(Layout(pp=2), 4096, 4096, 2, 1) == 2 * 4096 * 4096 * 2
    link = comm.Link(8, 8)
    hw = dataclasses.replace(H100, intra_latency_s=0.0)
    assert comm.all_reduce_time(1e9, link, hw) == pytest.approx(2 * 7 / 8 * 1e9 / hw.intra_bw)
    assert comm.gather_time(1e9, link, hw) == pytest.approx(7 / 8 * 1e9 / hw.intra_bw)


def test_placement_follows_parallel_order():
    layout = Layout(dp=4, tp=8, pp=2)
    order = ("pp", "dp", "cp", "tp")
    assert comm.placement(layout, order, ("tp",), 8).intra_node
    dp = comm.placement(layout, order, ("dp",), 8)
    assert not dp.intra_node and dp.per_node == 1
    tp_outer = comm.placement(layout, ("tp", "pp", "dp", "cp"), ("tp",), 8)
    assert not tp_outer.intra_node


def test_dp_bytes_by_zero_stage():
    w = workload_from_config(cfg_for("llama3-1b", "--train.global_batch", "64",
                                     "--train.seq_len", "2048"))
    def dp_bytes(zero):
        return estimate(w, Layout(dp=8, zero=zero, mbs=1), H100, DEFAULT_RUNTIME).comm_bytes["dp"]
    n, m = w.stats.total_params, 8
    g, p = w.precision.reduce_bytes, w.precision.param_bytes  # fp32 reduction, bf16 weights (#40)
    assert dp_bytes(0) == pytest.approx(2 * 7 / 8 * g * n, rel=1e-6)  # fp32 all-reduce
    assert dp_bytes(1) == pytest.approx(7 / 8 * (g * n + p * n), rel=1e-6)
    # zero 3: every micro-batch's gradients reduce-scattered (parallel/data/fsdp.py), all weights
    # gathered in forward and the blocks' again in backward (the root unit -- embedding, norm --
    # stays gathered).
    root = w.stats.vocab_size * w.stats.dim + w.stats.dim  # tied 1B: one table + final norm
    assert dp_bytes(3) == pytest.approx(7 / 8 * m * (g * n + p * n + p * (n - root)), rel=1e-6)


def test_more_dimensions_report_their_bytes():
    w = workload_from_config(cfg_for("mixtral-8x7b", "--train.global_batch", "64",
                                     "--train.seq_len", "8192"))
    est = estimate(w, Layout(dp=8, ep=8, cp=2, tp=2, mbs=1, zero=1), H100, DEFAULT_RUNTIME)
    assert all(est.comm_bytes[k] > 0 for k in ("dp", "tp", "cp", "ep"))
    assert est.comm_bytes["pp"] == 0


def test_planner_never_imports_torch():
    for path in Path(__file__).resolve().parents[1].joinpath("src/fivefold/plan").glob("*.py"):
        text = path.read_text()
        assert "import torch" not in text and "from torch" not in text, path.name


def test_layout_string_round_trip():
    layout = parse_layout("dp=8,zero=1,tp=2,pp=4,cp=1,ep=1,mbs=1,recompute=selective,pp_schedule=1f1b")
    assert (layout.dp, layout.zero, layout.tp, layout.pp, layout.mbs) == (8, 1, 2, 4, 1)
    assert layout.recompute == "selective" and layout.world_size == 64
