"""The planner against the Ultra-Scale Playbook's and torchtitan's published runs
(benchmarks/planner_accuracy.py).

These rows are benchmarks/calibrate_time.py's fit set: the checks below are in-sample regression
guards, each bar at least 10% away from what the model reaches (benchmarks/RESULTS.md, issue 53:
11.3% median, 19.8% at 32-64 nodes, Spearman 0.852, fit/OOM right 92.7% with the H100's 79.6 GiB,
memory 7.1%), so that a small honest change does not sit on the bar and a refit is never needed to
pass. The out-of-sample checks are in tests/test_plan_out_of_sample.py. Skipped where
../shared/data is not present (the CSVs are not part of the repository)."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("planner_accuracy", ROOT / "benchmarks" / "planner_accuracy.py")
accuracy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(accuracy)

# In-sample bars, each 10% beyond the calibrated model's value (docstring).
MEDIAN_BOUND = 0.125
BIG_RUNS_BOUND = 0.22
SPEARMAN_BOUND = 0.76
# Fit/OOM comes from the memory model, none of whose terms is fitted to these outcomes; 83% is the
# 10% margin below 92.7%, and a planner saying every run fits scores 1,620/2,483 = 65.2% (RESULTS.md).
FIT_RIGHT_BOUND = 0.83
MEMORY_BOUND = 0.08


def test_nanotron_pipeline_split_follows_its_cost_thresholds():
    # 8B: 32 layers, lm_head worth ~3.7 layers: early ranks take the extra layers
    assert accuracy.nanotron_pp_layers("8B", 4) == "9,9,8,6"
    assert accuracy.nanotron_pp_layers("1B", 8) == "3,3,2,3,2,3,0,0"
    # 1B on 16 stages leaves the last rank without any block: nanotron cannot run it
    assert accuracy.nanotron_pp_layers("1B", 16) is None


def test_spearman():
    assert accuracy.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert accuracy.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)


@pytest.mark.skipif(not accuracy.DEFAULT_CSV.is_file(), reason="published runs not available")
def test_accuracy_goals_on_published_runs():
    # Issue 20's targets were 12%, 20%, 0.85 and 93%: the fit sat on them. In-sample, so bars with
    # a margin (module docstring); the fit/OOM share fell from 93.2% to 92.7% when the capacity
    # became the H100's 81,559 MiB with the CUDA context and NCCL buffers counted (issue 53).
    with accuracy.DEFAULT_CSV.open() as f:
        rows = list(csv.DictReader(f))
    summary = accuracy.summarize(accuracy.predict(rows))
    assert summary["ran"] == 1620
    assert summary["median_tok_s_rel_error"] <= MEDIAN_BOUND
    assert summary["tok_s_error_by_scale"]["32-64 nodes"]["median_tok_s_rel_error"] <= BIG_RUNS_BOUND
    assert summary["fit_prediction_right"] >= FIT_RIGHT_BOUND
    # torch.cuda's peaks against the planner's allocator bytes (its total less context and NCCL)
    assert summary["median_mem_rel_error"] <= MEMORY_BOUND
    assert summary["spearman_median"] >= SPEARMAN_BOUND


@pytest.mark.skipif(not accuracy.TORCHTITAN_CSV.is_file(), reason="published runs not available")
def test_accuracy_on_torchtitan_runs_fitted_and_held_out():
    with accuracy.TORCHTITAN_CSV.open() as f:
        rows = list(csv.DictReader(f))
    pred = accuracy.titan_predict(rows)
    summary = accuracy.titan_summarize(pred)
    assert summary["median_tok_s_rel_error"] <= 0.12
    assert accuracy.titan_summarize(pred[1::2])["median_tok_s_rel_error"] <= 0.15  # held out
    assert summary["fit_prediction_right"] == 1.0  # every row ran
    assert summary["spearman"] >= 0.85


def _estimate(mbs, runtime, tp=1, layers=4, gpus_per_node=8):
    from fivefold.plan.estimate import estimate
    from fivefold.plan.hardware import hardware_for
    from fivefold.plan.layout import Layout

    work = accuracy.workload_for("1B")
    return estimate(work, Layout(dp=8, tp=tp, mbs=mbs, zero=1), hardware_for("h100", gpus_per_node), runtime)


def test_launch_overhead_shows_only_where_kernels_are_short():
    import dataclasses

    from fivefold.plan.speed.frameworks import FIVEFOLD_EAGER

    slow_host = dataclasses.replace(FIVEFOLD_EAGER, launch_s=100e-6)  # 11 ms of launches per layer
    short = _estimate(1, slow_host)  # 1 sequence per micro-batch: a layer's kernels take ~4 ms
    long = _estimate(16, slow_host)  # 16 sequences: ~60 ms per layer, launches hidden
    assert short.time_parts["host"] > 0
    assert long.time_parts["host"] == 0
    # the default eager profile hides its launches even at 1 sequence of 4096 tokens
    assert _estimate(1, FIVEFOLD_EAGER).time_parts["host"] == 0


def test_only_the_nanotron_profile_has_the_large_cluster_stall():
    from fivefold.plan.speed.frameworks import FIVEFOLD_COMPILED, FIVEFOLD_EAGER, NANOTRON_RUNTIME

    assert FIVEFOLD_EAGER.slot_stall_s == FIVEFOLD_COMPILED.slot_stall_s == 0
    assert FIVEFOLD_EAGER.pp_cross_node_wait_per_tp_peer_s == 0
    assert NANOTRON_RUNTIME.slot_stall_s > 0
    assert "stall" not in _estimate(1, FIVEFOLD_EAGER).time_parts


def test_every_prediction_carries_its_uncertainty_band():
    from fivefold.plan.speed.frameworks import FIVEFOLD_EAGER

    est = _estimate(2, FIVEFOLD_EAGER)
    band = est.to_json()["tokens_per_sec_band"]
    assert (band["median_rel_error"], band["p90_rel_error"]) == FIVEFOLD_EAGER.tokens_per_sec_error
    assert band["p90_low"] < est.tokens_per_sec_per_gpu < band["p90_high"]


def test_a_compiled_run_is_planned_with_the_compiled_profile():
    """train.compile picks the profile calibrated on compiled runs (Inductor fuses elementwise
    chains): plan_layout, the CLI's evaluation and the search all see it."""
    from fivefold.configure import load_config
    from fivefold.plan import estimate, plan_layout, workload_from_config
    from fivefold.plan.hardware import hardware_for
    from fivefold.plan.speed.frameworks import FIVEFOLD_COMPILED, FIVEFOLD_EAGER
    from fivefold.plan.layout import layout_from_config

    eager = load_config("llama3-8b", [])
    compiled = load_config("llama3-8b", ["--train.compile", "true"])
    hw, layout = hardware_for("h100"), layout_from_config(eager)
    want = estimate(workload_from_config(compiled), layout, hw, FIVEFOLD_COMPILED)
    assert plan_layout(compiled, layout).tokens_per_sec_per_gpu == want.tokens_per_sec_per_gpu
    assert plan_layout(eager, layout).tokens_per_sec_per_gpu == estimate(
        workload_from_config(eager), layout, hw, FIVEFOLD_EAGER).tokens_per_sec_per_gpu
    assert want.tokens_per_sec_per_gpu > plan_layout(eager, layout).tokens_per_sec_per_gpu
