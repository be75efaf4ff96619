"""Goodput with in-place healing (issue 55 item 5, plan/healing.py): the mechanisms against a
simulation of replica groups failing and healing, the limits, and what `fivefold plan` reports."""

from __future__ import annotations

import heapq
import json
import random

import pytest

from fivefold.plan import goodput as gp
from fivefold.plan import healing as heal
from fivefold.plan.cli import run_plan


def simulate_groups(replicas: int, min_replicas: int, rate: float, down_s: float, step_s: float,
                    wall: float, seed: int) -> tuple[float, int]:
    """(share of full-strength work done, whole-job failures) over `wall` seconds: each group fails
    at exponential times (mean 1 / rate) while up and is down for down_s; the job trains at
    live / R of its full rate; a live group's failure loses one step of the live job's work; a
    whole-job failure is counted when a failure leaves R - min_replicas + 1 groups down (the job
    restarts then; the simulation counts it and lets the groups go on, as the rate assumes)."""
    rng = random.Random(seed)
    events = [(rng.expovariate(rate), g, "fail") for g in range(replicas)]
    heapq.heapify(events)
    live, now, work, stops = replicas, 0.0, 0.0, 0
    while events and events[0][0] < wall:
        t, g, kind = heapq.heappop(events)
        work += (t - now) * live / replicas
        now = t
        if kind == "fail":
            work -= step_s * live / replicas  # the interrupted step is not committed
            live -= 1
            stops += replicas - live == replicas - min_replicas + 1  # the first group too many
            heapq.heappush(events, (t + down_s, g, "back"))
        else:
            live += 1
            heapq.heappush(events, (t + rng.expovariate(rate), g, "fail"))
    work += (wall - now) * live / replicas
    return work / wall, stops


def test_healing_matches_a_simulation_of_failing_groups():
    # groups down a sixth of the time, so that two down at once happens thousands of times
    replicas, rate, down, step, wall = 4, 1 / 1000, 200.0, 5.0, 3e6
    share, stops = simulate_groups(replicas, 3, rate, down, step, wall, seed=1)
    assert share == pytest.approx(heal.healing_share(replicas, rate, down, step), rel=0.01)
    expected = heal.job_failure_rate(replicas, 3, rate, down) * wall
    assert stops == pytest.approx(expected, rel=0.05)  # ~3,500 whole-job stops: noise ~2%
    # no spare group (min_replicas = R): every failure of a live group stops the job
    _, every = simulate_groups(replicas, 4, rate, down, step, wall, seed=2)
    assert every == pytest.approx(heal.job_failure_rate(replicas, 4, rate, down) * wall, rel=0.03)


def test_the_limits():
    delta, restart, step = 10.0, 600.0, 20.0
    # no failures: everything trains
    assert gp.healing_goodput(8, 1, 0.0, step, restart, 1.0, delta)[0] == 1.0
    # one group (no peer to heal from) and min_replicas = R (any failure stops the quorum) are
    # checkpoint-restart at the job's rate
    rate = 1 / 5000
    restart_only = gp.goodput_at(gp.best_interval(delta, 5000, restart + delta), delta, 5000, restart + delta)
    assert gp.healing_goodput(1, 1, rate, step, restart, 1.0, delta)[0] == pytest.approx(restart_only)
    assert gp.healing_goodput(4, 4, rate / 4, step, restart, 1.0, delta)[0] == pytest.approx(restart_only)
    # one spare group already beats it, and more spares are never worse
    by_spares = [gp.healing_goodput(4, 4 - s, rate / 4, step, restart, 1.0, delta)[0] for s in range(4)]
    assert by_spares[1] > by_spares[0] and by_spares == sorted(by_spares)


def test_plan_states_healing_beside_checkpoint_restart(capsys):
    args = ["--model.preset", "llama3-405b", "--train.dtype", "bf16", "--train.seq_len", "8192",
            "--train.global_batch", "2048", "--cluster.gpus", "8192", "--train.steps", "1000", "--json",
            "--layout", "dp=64,tp=8,pp=16,zero=1,dp_shard=8,mbs=1,recompute=full,pp_schedule=1f1b"]
    assert run_plan(args) == 0
    plain = json.loads(capsys.readouterr().out)["candidates"][0]
    assert "healing" not in plain  # the contract without [ft] is unchanged
    assert run_plan(args + ["--ft.replicas", "8"]) == 0
    cand = json.loads(capsys.readouterr().out)["candidates"][0]
    h = cand["healing"]
    assert cand["goodput"] == plain["goodput"] and cand["goodput"] < h["goodput"] < 1
    # a group is 1,024 GPUs: it fails every 50,700 / 1,024 hours
    assert h["group_mtbf_s"] == pytest.approx(gp.DEFAULTS["mtbf_gpu_hours"] * 3600 / 1024)
    assert h["goodput_by_spare_groups"][0] == pytest.approx(cand["goodput"])
    assert h["train_days"] < cand["train_days"]
    assert run_plan(args + ["--ft.replicas", "6"]) == 0  # 64 is no multiple of 6: said, not priced
    assert "multiple" in json.loads(capsys.readouterr().out)["candidates"][0]["healing"]["problem"]
