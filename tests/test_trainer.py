"""The single-process trainer: learning, gradient accumulation, schedules, metrics, bf16, recompute.

All runs use the tiny config of tests/layouts.py (fp32, 6 steps unless stated). Module-scoped
fixtures share runs between tests: on 2 busy cores a run costs a few seconds.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from fivefold.config import TrainConfig
from fivefold.runtime import runtime_from_env
from fivefold.train.optim import lr_multiplier
from fivefold.config import micro_batches
from fivefold.train.trainer import autocast, train

from layouts import WEIGHT_ATOL, tiny_config

QUIET = {"log": {"every": 1000}}  # console lines only at the first and last step
REQUIRED_KEYS = ("step", "loss", "grad_norm", "lr", "tokens_per_sec", "tokens_per_sec_per_gpu", "mfu", "step_time_s", "peak_mem_bytes")


def _with(*overrides: dict) -> dict:
    out: dict = {}
    for o in overrides:
        for section, values in o.items():
            out.setdefault(section, {}).update(values)
    return out


def run(overrides: dict):
    cfg = tiny_config(_with(QUIET, overrides))
    result = train(cfg)
    norms = [r["grad_norm"] for r in result.records]
    return cfg, result, norms, result.parallel.full_state_dict()


def assert_close_runs(got, want, rtol: float, weight_atol: float, label: str):
    _, result, norms, weights = got
    _, ref_result, ref_norms, ref_weights = want
    assert len(result.losses) == len(ref_result.losses) == 6
    for step, (a, b) in enumerate(zip(result.losses, ref_result.losses), 1):
        assert abs(a - b) <= rtol * abs(b), f"{label}: step {step} loss {a} vs {b}"
    for step, (a, b) in enumerate(zip(norms, ref_norms), 1):
        assert abs(a - b) <= rtol * abs(b), f"{label}: step {step} grad norm {a} vs {b}"
    assert weights.keys() == ref_weights.keys()
    for name, tensor in weights.items():
        diff = (tensor - ref_weights[name]).abs().max().item()
        assert diff <= weight_atol, f"{label}: {name} differs by {diff}"


@pytest.fixture(scope="module")
def reference():
    """fp32, one micro-batch of 8 sequences per step, no recomputation."""
    return run({})


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """30 steps with metrics.jsonl, evaluation and the communication ledger every 10 steps."""
    run_dir = tmp_path_factory.mktemp("run")
    cfg, result, _, _ = run({"train": {"steps": 30, "eval_every": 10},
                             "log": {"dir": str(run_dir), "comm_every": 10}})
    return cfg, result, run_dir


# ---------------------------------------------------------------- learning


def test_loss_decreases_clearly(long_run):
    _, result, _ = long_run
    losses = result.losses
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(256)) < 0.5, losses[0]  # starts near uniform over bytes
    late = sum(losses[-5:]) / 5
    assert late < 0.75 * losses[0], f"loss went from {losses[0]:.3f} to {late:.3f} only"
    assert late < sum(losses[10:15]) / 5  # still improving after the first third


# ---------------------------------------------------------------- gradient accumulation


def test_micro_batch_arithmetic():
    assert micro_batches(tiny_config()) == 1
    assert micro_batches(tiny_config({"train": {"micro_batch": 2}})) == 4
    assert micro_batches(tiny_config({"train": {"micro_batch": 1}})) == 8
    assert micro_batches(tiny_config({"parallel": {"dp": 2}, "train": {"micro_batch": 1}})) == 4


def test_gradient_accumulation_equals_one_big_batch(reference):
    got = run({"train": {"micro_batch": 2}})  # 4 micro-batches of 2 sequences
    assert micro_batches(got[0]) == 4
    # The micro-batch split reassociates the gradient sums: losses move by ~2e-7, and AdamW turns that
    # into up to 1.6e-6 on weights whose gradients nearly cancel (AVX-512; less on AVX2): the
    # tolerance rule of tests/layouts.py. A wrong scale of one micro-batch moves losses by 1e-3.
    assert_close_runs(got, reference, rtol=1e-6, weight_atol=WEIGHT_ATOL, label="4 micro-batches")


# ---------------------------------------------------------------- learning-rate schedules


def test_warmup_is_linear():
    cfg = TrainConfig(steps=100, warmup=10, schedule="cosine", min_lr_ratio=0.1)
    assert [lr_multiplier(s, cfg) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lr_multiplier(9, cfg) == 1.0
    assert lr_multiplier(10, cfg) == pytest.approx(1.0)  # cosine starts at the peak
    assert lr_multiplier(0, TrainConfig(steps=100, warmup=0, schedule="constant")) == 1.0


def test_cosine_ends_at_min_lr_ratio():
    cfg = TrainConfig(steps=110, warmup=10, schedule="cosine", min_lr_ratio=0.1)
    values = [lr_multiplier(s, cfg) for s in range(10, 111)]
    assert all(a > b for a, b in zip(values, values[1:])), "cosine must decrease after warmup"
    assert lr_multiplier(60, cfg) == pytest.approx((1 + 0.1) / 2)  # half way: mid point
    assert lr_multiplier(35, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_multiplier(109, cfg) == pytest.approx(0.1, abs=1e-3)  # the last step: at the floor
    assert lr_multiplier(110, cfg) == pytest.approx(0.1)
    assert lr_multiplier(500, cfg) == pytest.approx(0.1)  # never below the floor


def test_wsd_is_flat_then_decays_to_the_floor():
    cfg = TrainConfig(steps=100, warmup=10, schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.1)
    assert [lr_multiplier(s, cfg) for s in range(10, 80)] == [1.0] * 70
    decay = [lr_multiplier(s, cfg) for s in range(80, 100)]
    assert decay[0] == pytest.approx(1 - 0.9 / 20)
    steps = [a - b for a, b in zip(decay, decay[1:])]
    assert steps == pytest.approx([0.9 / 20] * 19)  # linear
    assert decay[-1] == pytest.approx(0.1)


def test_constant_after_warmup():
    cfg = TrainConfig(steps=50, warmup=5, schedule="constant", min_lr_ratio=0.1)
    assert [lr_multiplier(s, cfg) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert [lr_multiplier(s, cfg) for s in range(5, 60)] == [1.0] * 55


def test_trainer_applies_the_schedule(long_run):
    cfg, result, _ = long_run
    for record in result.records:
        want = cfg.train.lr * lr_multiplier(record["step"] - 1, cfg.train)
        assert record["lr"] == pytest.approx(want, rel=1e-12), f"step {record['step']}"
    assert result.records[0]["lr"] == pytest.approx(cfg.train.lr / cfg.train.warmup)


# ---------------------------------------------------------------- metrics and evaluation


def test_metrics_jsonl(long_run):
    cfg, result, run_dir = long_run
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == list(range(1, 31))
    for r in records:
        missing = [k for k in REQUIRED_KEYS if k not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["lr"] > 0
        assert r["tokens_per_sec"] > 0 and r["step_time_s"] > 0
        assert r["peak_mem_bytes"] is None or (isinstance(r["peak_mem_bytes"], int) and r["peak_mem_bytes"] > 0)
        if runtime_from_env().device.type == "cpu":
            assert r["mfu"] is None
        else:
            assert r["mfu"] is None or 0 < r["mfu"] < 1
    assert [r["loss"] for r in records] == result.losses
    assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in result.records]


def test_communication_is_measured_on_the_first_last_and_every_nth_step(long_run):
    _, _, run_dir = long_run  # log.comm_every = 10, 30 steps
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "comm_bytes" in r] == [1, 10, 20, 30]


def test_eval_every_produces_val_loss(long_run):
    _, result, run_dir = long_run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    with_val = [r["step"] for r in records if "val_loss" in r]
    assert with_val == [10, 20, 30]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert all(math.isfinite(v) and 0 < v < math.log(256) for v in val)
    assert val[-1] < val[0], f"held-out loss did not fall: {val}"
    assert [r.get("val_loss") for r in result.records] == [r.get("val_loss") for r in records]


def test_no_evaluation_by_default(reference):
    assert reference[0].train.eval_every == 0
    assert all("val_loss" not in r for r in reference[1].records)


# ---------------------------------------------------------------- bf16


def test_bf16_tracks_fp32(reference):
    """bf16 weights, fp32 master weights in the optimizer. Stated tolerance: every step's loss
    within 2% and grad norm within 10% of fp32 (measured: ~1e-4 and ~6e-3 on the tiny config)."""
    cfg, result, norms, _ = got = run({"train": {"dtype": "bf16"}})
    _, ref_result, ref_norms, _ = reference
    for step, (a, b) in enumerate(zip(result.losses, ref_result.losses), 1):
        assert abs(a - b) <= 0.02 * b, f"step {step}: bf16 loss {a} vs fp32 {b}"
    for step, (a, b) in enumerate(zip(norms, ref_norms), 1):
        assert abs(a - b) <= 0.10 * b, f"step {step}: bf16 grad norm {a} vs fp32 {b}"
    assert result.losses != ref_result.losses, "bf16 run is bit-identical to fp32: autocast not applied"
    assert result.losses[-1] < result.losses[0] - 0.5
    model = result.parallel.model
    assert all(p.dtype == torch.bfloat16 for p in model.parameters()), "the model's weights are bf16"
    masters = result.parallel.data_parallel.chunks  # the optimizer's fp32 master weights
    assert masters and all(m.dtype == torch.float32 for m in masters)
    tokens = torch.randint(0, 256, (1, 8))
    with torch.no_grad(), autocast(cfg, torch.device("cpu")):
        assert model(tokens).dtype == torch.bfloat16
    assert got[3].keys() == reference[3].keys()


# ---------------------------------------------------------------- activation recomputation


def _block_forwards_per_step(model) -> int:
    """How often block 0's feed-forward starts in one forward+backward (2 when it is recomputed).

    A pre-hook, because recomputation stops early once it has what backward needs (before the
    module's forward returns), so a post-forward hook would not see the second run."""
    calls = []
    handle = model.layers["0"].feed_forward.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        model(torch.randint(0, 256, (2, 16))).float().mean().backward()
    finally:
        handle.remove()
    model.zero_grad(set_to_none=True)
    return len(calls)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_the_same_run(reference, mode):
    got = run({"train": {"recompute": mode}})
    assert_close_runs(got, reference, rtol=1e-6, weight_atol=1e-6, label=f"recompute={mode}")
    assert _block_forwards_per_step(got[1].parallel.model) == 2, f"recompute={mode} did not recompute"
    assert _block_forwards_per_step(reference[1].parallel.model) == 1
