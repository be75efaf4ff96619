"""train.compile (issue 28): `auto` compiles where the run is predicted to win back the compile
time and says why in one sentence; the compile time of a step is in its metrics record and on the
console; the planner predicts a config with the profile `auto` chose."""

from __future__ import annotations

import functools

import pytest
import torch

from fivefold.configure import load_config
from fivefold.plan.compile_choice import COLD_COMPILE_S, block_kinds, choose_compile, planned_compile


def _config(name=None, **train):
    return load_config(name, {"train": {"compile": "auto", **train}})


# A short run: 5 steps of llama3-8b save a few seconds each when compiled, far enough under the 60 s
# a cold compile costs that a refit of the planner's speed constants does not carry it across.
@pytest.mark.parametrize("steps, compiles", [(5, False), (20_000, True)])
def test_auto_on_gpus_compiles_a_long_run_only(steps, compiles):
    cfg = _config("llama3-8b", steps=steps)
    choice = choose_compile(cfg, "cuda")
    assert choice.compile is compiles and planned_compile(cfg) is compiles
    verdict = "compiling the blocks" if compiles else "eager"
    assert choice.reason.startswith(f"train.compile=auto: {verdict}: {steps} steps x ")
    assert "s to compile 1 block kind cold" in choice.reason and f"{COLD_COMPILE_S['cuda']:.0f} s" in choice.reason


def test_auto_on_this_cpu_keeps_the_tiny_model_eager():
    """The tiny default model saves microseconds a step: 300 steps never pay 20 s of Inductor."""
    choice = choose_compile(_config(), "cpu")
    assert not choice.compile and "<= 20 s to compile 1 block kind cold" in choice.reason


def test_true_and_false_are_not_second_guessed():
    assert choose_compile(load_config(None, {"train": {"compile": True, "steps": 1}}), "cpu").compile
    assert not choose_compile(load_config("llama3-8b", {"train": {"steps": 10**6}}), "cuda").compile
    assert choose_compile(load_config(None, {"train": {"compile": "true"}}), "cpu").reason == ""


@pytest.mark.parametrize("model, kinds", [
    ({}, 1),
    ({"preset": "tiny-gpt-oss"}, 2),  # sliding and full attention layers
    ({"preset": "tiny-deepseek-v3"}, 2),  # a dense first layer, then MoE
    ({"preset": "tiny-gpt-oss", "sliding_window": 0}, 1),
])
def test_one_compiled_graph_per_block_kind(model, kinds):
    assert block_kinds(load_config(None, {"model": model}).model) == kinds


def test_compile_time_is_in_the_step_record_and_the_console(monkeypatch, capsys):
    from fivefold.train.trainer import train

    # aot_eager: Dynamo and AOT autograd trace and time the same way as Inductor, without its C++ build.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    # Dynamo keeps what it compiled for the process: an earlier test in this worker that compiled the
    # same blocks would leave this run's first step nothing to compile.
    torch._dynamo.reset()
    cfg = load_config(None, {"train": {"compile": True, "steps": 2, "seq_len": 32, "global_batch": 4},
                             "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128},
                             "data": {"builtin_max_bytes": 100_000}, "log": {"progress": True}})
    first, second = train(cfg).records
    assert 0 < first["compile_s"] < first["step_time_s"] and "compile_s" not in second
    assert f"step 1: torch.compile took {first['compile_s']:.1f} s of the step's" in capsys.readouterr().out
