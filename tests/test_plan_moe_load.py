"""MoE load imbalance in the planner (issue 41, plan/speed/expert_load.py): the busiest expert-parallel
rank's routed rows set an MoE layer's expert GEMMs, all-to-all and kept copies. The default, the
least that random routing gives, is checked against simulated routing; a measured imbalance and a
capacity factor against the arithmetic they stand for. Pure arithmetic; no timing asserts."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch

from fivefold.config import ModelConfig
from fivefold.config.schema import MoEConfig
from fivefold.plan.memory.activations import fivefold_layer_bytes
from fivefold.plan.estimate import estimate
from fivefold.plan.speed.gemm import M_TILE, expected_padded_rows
from fivefold.plan.speed.expert_load import expected_max_normal, rank_imbalance, routing_noise_imbalance
from fivefold.plan.hardware import hardware_for
from fivefold.plan.speed.frameworks import FIVEFOLD_EAGER
from fivefold.plan.layout import Layout
from fivefold.plan.model_stats import model_stats
from fivefold.plan.workload import PRECISIONS, Workload

H100 = hardware_for("h100")


def _workload(n_experts=64, top_k=8, seq=4096, expert_ffn=2048, **moe):
    model = ModelConfig(dim=4096, n_layers=8, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                        max_seq_len=seq, moe=MoEConfig(n_experts=n_experts, top_k=top_k, expert_ffn_dim=expert_ffn))
    return Workload(stats=model_stats(model), seq_len=seq, global_batch=64, precision=PRECISIONS["bf16"], **moe)


def _simulated_imbalance(rows: int, top_k: int, n_experts: int, ep: int, trials: int) -> float:
    """Mean over micro-batches of max/mean rank load when every rank routes `rows` tokens each to
    top_k distinct experts drawn uniformly (a router balanced in expectation)."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(trials, ep * rows, n_experts, generator=gen)
    chosen = scores.topk(top_k, dim=-1).indices  # (trials, tokens, k)
    per_expert = torch.zeros(trials, n_experts).scatter_add_(1, chosen.flatten(1), torch.ones(trials, chosen[0].numel()))
    per_rank = per_expert.view(trials, ep, n_experts // ep).sum(-1)
    return (per_rank.max(-1).values / per_rank.mean(-1)).mean().item()


def test_expected_maximum_of_normals():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-4)  # closed form
    assert expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), abs=1e-4)  # closed form
    assert expected_max_normal(8) == pytest.approx(1.4236, abs=1e-3)  # tabulated order statistics


@pytest.mark.parametrize("rows,top_k,n_experts,ep", [(64, 2, 4, 2), (128, 2, 8, 4), (32, 8, 64, 8), (256, 1, 16, 16)])
def test_routing_noise_is_what_random_balanced_routing_gives(rows, top_k, n_experts, ep):
    """The formula's excess over an even load within 10% of simulated routing's; each case also
    tells the distinct-experts term (E - k)/(E - 1) apart from independent draws where it matters."""
    predicted = routing_noise_imbalance(rows, top_k, n_experts, ep)
    simulated = _simulated_imbalance(rows, top_k, n_experts, ep, trials=400)
    assert predicted > 1.0
    assert abs((predicted - 1) - (simulated - 1)) <= 0.10 * (simulated - 1), (predicted, simulated)


@pytest.mark.parametrize("mean_rows", [3.0, 60.0, 128.0, 256.0, 300.0, 2000.0])
def test_tile_padding_is_that_of_random_counts(mean_rows):
    """A grouped GEMM pads each expert's rows to the M tile; counts drawn around their mean (Poisson)
    pad to the formula's rows within 2%, also at an exact multiple of the tile, where the mean
    count alone would pad nothing."""
    counts = torch.poisson(torch.full((20000,), mean_rows), generator=torch.Generator().manual_seed(0))
    simulated = (torch.ceil(counts / M_TILE) * M_TILE).mean().item()
    assert expected_padded_rows(mean_rows) == pytest.approx(simulated, rel=0.02)
    assert expected_padded_rows(mean_rows) >= mean_rows


def test_more_rows_even_the_load_and_one_rank_has_none_to_wait_for():
    few, many = (routing_noise_imbalance(rows, 8, 256, 64) for rows in (512, 8192))
    assert few > many > 1.0
    assert routing_noise_imbalance(4096, 8, 256, 1) == 1.0
    assert routing_noise_imbalance(4096, 4, 4, 4) == 1.0  # every token visits every expert


def test_measured_imbalance_and_capacity_factor():
    layout = Layout(dp=8, ep=8, mbs=1, zero=1)
    w = _workload()
    assert rank_imbalance(w, layout) == pytest.approx(routing_noise_imbalance(4096, 8, 64, 8))
    assert rank_imbalance(dataclasses.replace(w, moe_rank_imbalance=1.5), layout) == 1.5
    capped = dataclasses.replace(w, moe_rank_imbalance=1.5, capacity_factor=1.25)
    assert rank_imbalance(capped, layout) == 1.25  # no expert takes more than 1.25x its share
    assert rank_imbalance(dataclasses.replace(w, moe_rank_imbalance=1.5), Layout(dp=8, mbs=1)) == 1.0


def test_the_busiest_rank_sets_the_expert_time_and_the_all_to_all():
    layout = Layout(dp=8, ep=8, mbs=1, zero=1)
    even = estimate(dataclasses.replace(_workload(), moe_rank_imbalance=1.0), layout, H100, FIVEFOLD_EAGER)
    skewed = estimate(dataclasses.replace(_workload(), moe_rank_imbalance=1.5), layout, H100, FIVEFOLD_EAGER)
    assert "expert_imbalance" not in even.to_json()["time_parts_s"]
    assert skewed.to_json()["moe_rank_imbalance"] == 1.5
    wait = skewed.time_parts["expert_imbalance"]
    # Everything but the experts is the same: the other ranks wait on the busiest one's half again
    # as many rows, at (nearly) the same GEMM efficiency: between 0.4 and 0.5 of the even expert time.
    assert skewed.time_parts["compute"] == pytest.approx(even.time_parts["compute"], rel=1e-9)
    experts = _expert_seconds(layout)
    assert 0.4 * experts < wait <= 0.5 * experts * 1.001, (wait, experts)
    # The all-to-all's bandwidth part grows with the busiest rank's rows.
    assert 1.3 < skewed.time_parts["ep"] / even.time_parts["ep"] <= 1.5
    assert skewed.step_time_s > even.step_time_s
    # Its copies: the busiest rank keeps half again as many routed rows.
    assert skewed.memory.activations > even.memory.activations


def _expert_seconds(layout) -> float:
    """The experts' share of an even step: the step with experts twice as wide, minus the even step
    (FLOPs and GEMMs of this size grow about linearly with the width)."""
    def step_compute(ffn):
        w = _workload(expert_ffn=ffn, moe_rank_imbalance=1.0)
        return estimate(w, layout, H100, FIVEFOLD_EAGER).time_parts["compute"]
    return step_compute(4096) - step_compute(2048)


def test_the_busiest_rank_keeps_more_routed_copies():
    stats = _workload().stats
    layout = Layout(dp=8, ep=8, mbs=1)
    layer = next(i for i in range(stats.n_layers) if stats.is_moe(i))
    args = (stats, layer, layout, 4096, "none", PRECISIONS["bf16"], True)
    extra = fivefold_layer_bytes(*args, imbalance=1.5) - fivefold_layer_bytes(*args)
    # half again the k dispatched copies: input h, expert output h, combined copy h and the SwiGLU 3f
    assert extra == pytest.approx(0.5 * 3 * stats.top_k * (stats.dim + stats.expert_hidden) * 2)


def test_dense_models_are_untouched():
    model = ModelConfig(dim=4096, n_layers=8, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                        max_seq_len=4096)
    w = Workload(stats=model_stats(model), seq_len=4096, global_batch=64, precision=PRECISIONS["bf16"])
    layout = Layout(dp=8, mbs=1)
    a = estimate(w, layout, H100, FIVEFOLD_EAGER)
    b = estimate(dataclasses.replace(w, moe_rank_imbalance=2.0), layout, H100, FIVEFOLD_EAGER)
    assert a.step_time_s == b.step_time_s and a.memory.total == b.memory.total
    assert "moe_rank_imbalance" not in b.to_json()


def _plan(*extra):
    return subprocess.run([sys.executable, "-m", "fivefold", "plan", "--model.preset", "mixtral-8x7b",
                           "--layout", "dp=8,ep=8,pp=4,mbs=1,recompute=selective", "--train.seq_len", "4096",
                           "--train.global_batch", "256", "--json", *extra], capture_output=True, text=True)


def test_cli_takes_a_measured_imbalance_and_refuses_a_bad_one():
    import json
    given = _plan("--moe-rank-imbalance", "1.4")
    assert given.returncode == 0, given.stderr
    assert json.loads(given.stdout)["candidates"][0]["moe_rank_imbalance"] == 1.4
    for bad in ("0.8", "abc", "inf"):
        out = _plan("--moe-rank-imbalance", bad)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert out.stderr.strip().count("\n") == 0 and "--moe-rank-imbalance must be a number >= 1" in out.stderr


def test_cli_reads_the_imbalance_a_run_logged(tmp_path):
    """A run's metrics.jsonl (docs/moe.md: moe_layers[*].rank_imbalance under ep): the median step's
    mean over the MoE layers, the wait a step pays (each layer waits for its own busiest rank)."""
    import json
    metrics = tmp_path / "metrics.jsonl"
    steps = [{"step": 1, "loss": 5.0, "moe_layers": {"0": {"rank_imbalance": 1.2}, "1": {"rank_imbalance": 1.6}}},
             {"step": 2, "loss": 4.9},  # a step that logged no router metrics
             {"step": 3, "loss": 4.8, "moe_layers": {"0": {"rank_imbalance": 1.1}, "1": {"rank_imbalance": 1.3}}},
             {"step": 4, "loss": 4.7, "moe_layers": {"0": {"rank_imbalance": 1.5}, "1": {"rank_imbalance": 1.9}}}]
    metrics.write_text("\n".join(json.dumps(s) for s in steps) + "\n")
    out = _plan("--moe-rank-imbalance", str(metrics))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["candidates"][0]["moe_rank_imbalance"] == pytest.approx(1.4)  # median of 1.4, 1.2, 1.7
    dense = tmp_path / "dense.jsonl"
    dense.write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    for path, words in ((dense, "logs no rank_imbalance"), (broken, "line 1 of")):
        out = _plan("--moe-rank-imbalance", str(path))
        assert out.returncode == 2 and "Traceback" not in out.stderr and words in out.stderr
        assert out.stderr.strip().count("\n") == 0
