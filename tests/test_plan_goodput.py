"""Goodput and cost (issue 53, plan/goodput.py): the formula against a simulation of failures, the
optimum interval against Young's and Daly's, and what `fivefold plan --json` reports."""

from __future__ import annotations

import json
import random

import pytest

from fivefold.plan import goodput as gp
from fivefold.plan.cli import run_plan


def simulate(tau: float, delta: float, mtbf: float, recover: float, work: float, seed: int) -> float:
    """Wall time to finish `work` seconds of training: segments of tau training + delta checkpoint;
    failures at exponential times (mean mtbf), also during a checkpoint or a recovery; a failure
    loses the segment and costs `recover` before the segment starts again."""
    rng = random.Random(seed)
    wall, done = 0.0, 0.0
    next_failure = rng.expovariate(1 / mtbf)
    while done < work:
        need = tau + delta
        if wall + need <= next_failure:  # the segment and its checkpoint complete
            wall += need
            done += tau
            continue
        wall = next_failure  # lost: recover (failures may strike again while recovering)
        next_failure = wall + rng.expovariate(1 / mtbf)
        while wall + recover > next_failure:
            wall = next_failure
            next_failure = wall + rng.expovariate(1 / mtbf)
        wall += recover
    return wall


def test_the_goodput_formula_matches_a_simulation_of_failures():
    mtbf, delta, recover = 3600.0, 30.0, 300.0
    tau = gp.best_interval(delta, mtbf, recover)
    work = 2e7  # ~5,500 failures: the simulated share's noise is well under 1%
    simulated = work / simulate(tau, delta, mtbf, recover, work, seed=1)
    assert simulated == pytest.approx(gp.goodput_at(tau, delta, mtbf, recover), rel=0.01)
    # and the optimum is one: intervals half and twice as long train less of the time
    for other in (tau / 2, 2 * tau):
        assert work / simulate(other, delta, mtbf, recover, work, seed=1) < simulated


def test_the_best_interval_is_young_s_and_daly_s_where_they_hold():
    mtbf, delta = 50_000.0, 10.0  # delta << M
    best = gp.best_interval(delta, mtbf, recover=600.0)
    assert best == pytest.approx(gp.daly_interval(delta, mtbf), rel=0.01)
    assert best == pytest.approx(gp.young_interval(delta, mtbf), rel=0.03)
    # more failures, shorter intervals and less goodput
    assert gp.best_interval(delta, mtbf / 10, 600.0) < best
    assert gp.goodput_at(best, delta, mtbf, 600.0) > gp.goodput_at(
        gp.best_interval(delta, mtbf / 10, 600.0), delta, mtbf / 10, 600.0)


def test_plan_reports_goodput_and_cost_at_8192_gpus(capsys):
    code = run_plan(["--model.preset", "llama3-405b", "--train.dtype", "bf16", "--train.seq_len", "8192",
                     "--train.global_batch", "2048", "--cluster.gpus", "8192", "--train.steps", "1000", "--json",
                     "--layout", "dp=64,tp=8,pp=16,zero=1,mbs=1,recompute=full,pp_schedule=1f1b"])
    out = capsys.readouterr()
    assert code == 0, out.err
    cand = json.loads(out.out)["candidates"][0]
    assert 0.5 < cand["goodput"] < 1
    # 405B x 14 bytes (bf16 weights, fp32 master and moments) over 1,024 nodes at 1 GB/s each: ~5.5 s;
    # the job's MTBF is 50,700 / 8,192 GPU-hours: Young's interval sqrt(2 x 5.5 x 22,300 s) ~ 500 s
    assert cand["checkpoint_interval_s"] == pytest.approx((2 * 5.54 * 50677 * 3600 / 8192) ** 0.5, rel=0.05)
    hours = cand["train_days"] * 24
    assert hours == pytest.approx(1000 * cand["step_time_s"] / cand["goodput"] / 3600)
    assert cand["usd"] == pytest.approx(hours * 8192 * gp.DEFAULTS["usd_per_gpu_hour"])
    assert cand["kwh"] == pytest.approx(hours * 8192 * 700 / 1000)


def test_the_table_states_goodput_and_cost(capsys):
    code = run_plan(["--model.preset", "llama3-8b", "--cluster.gpus", "16", "--train.steps", "100",
                     "--layout", "dp=16,zero=1,mbs=1"])
    out = capsys.readouterr().out
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("1. goodput "))
    assert "checkpoint every" in line and "days" in line and "$" in line and "kWh" in line
