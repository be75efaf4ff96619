"""`fivefold train ... --parallel.auto true` (and `--KEY auto`): the planner's top pick among the
layouts the training code accepts is what gets trained."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from fivefold.cli import commands as cli
from fivefold.config import ConfigError
from fivefold.configure import load_config
from fivefold.plan import auto
from fivefold.plan.speed.frameworks import DEFAULT_RUNTIME, runtime_for
from fivefold.plan.layout import config_with_layout, layout_from_config
from fivefold.plan.search import search, without_ignored
from fivefold.plan.workload import workload_from_config
from fivefold.configure import validate
from fivefold.configure.machine import check_machine

SMALL = ["--model.dim", "64", "--model.n_layers", "2", "--model.ffn_dim", "128", "--train.seq_len", "32",
         "--train.global_batch", "8", "--data.builtin_max_bytes", "200000", "--log.every", "1"]


def _choose(config, overrides, world):
    rest, free = auto.split_auto(overrides)
    cfg = load_config(config, rest)
    hw, _ = auto.job_hardware(cfg, world, None)
    return cfg, hw, free, auto.choose(cfg, world, hw, DEFAULT_RUNTIME, free, check=check_machine)


def _valid(cfg, layout, world) -> bool:
    try:
        validate(config_with_layout(auto.planning_config(cfg), layout), world, on_this_machine=True)
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("config,world", [("tiny", 4), ("tiny", 8), ("tiny", 6), ("tiny", 1),
                                          ("tiny-moe", 4)])
def test_auto_true_trains_the_planners_top_valid_layout(config, world):
    preset = ["--model.preset", config] if config != "tiny" else []
    cfg, hw, free, choice = _choose("tiny", [*preset, "--parallel.auto", "true"], world)
    best = choice.best.layout
    assert _valid(cfg, best, world)
    # The planner's own search over the same world: its fastest layout that the trainer accepts.
    ranked = search(auto.planning_config(cfg), workload_from_config(cfg), hw, DEFAULT_RUNTIME, world).ranked
    top = next(est.layout for est in ranked if _valid(cfg, est.layout, world))
    assert best == top
    # The overrides handed to the ranks say exactly that layout.
    trained = load_config("tiny", [*preset, *auto.as_overrides(best, free)])
    assert without_ignored(layout_from_config(trained)) == without_ignored(best)
    if choice.runner_up is not None:
        assert choice.runner_up.layout != best and "best: " in choice.best.why


def test_sequence_parallelism_is_chosen_by_speed_when_memory_allows():
    """tiny.toml trains tp=2 with sp on. Eager, sp costs a backward re-gather per sub-layer and saves
    activation memory the tiny model does not need: `--parallel.sp auto` turns it off, and says
    so as an override the config accepts. Compiled blocks re-gather nothing: sp stays."""
    cfg, hw, free, choice = _choose("tiny", ["--train.micro_batch", "2", "--parallel.sp", "auto"], 4)
    assert free == {"sp"} and choice.best.layout.tp == 2 and choice.best.layout.sp is False
    overrides = auto.as_overrides(choice.best.layout, free)
    assert overrides == ["--parallel.sp", "False"] and load_config("tiny", overrides).parallel.sp is False
    with_sp = [e for e in choice.valid if e.layout.sp and
               dataclasses.replace(e.layout, sp=False) == choice.best.layout]
    assert with_sp and with_sp[0].step_time_s > choice.best.step_time_s
    assert with_sp[0].memory.activations < choice.best.memory.activations  # what sp buys

    compiled = search(auto.planning_config(cfg), workload_from_config(cfg), hw, runtime_for(True), 4).ranked
    twins = {e.layout.sp: e for e in compiled if dataclasses.replace(e.layout, sp=False) == choice.best.layout}
    assert twins[True].step_time_s <= twins[False].step_time_s  # sp also splits the norms' work over tp
    assert compiled.index(twins[True]) < compiled.index(twins[False])


def test_single_auto_key_keeps_every_other_key_as_given():
    # tiny.toml says dp=2 tp=2 zero=1; only pp is left to the planner (8 ranks: pp must be 2).
    cfg, hw, free, choice = _choose("tiny", ["--train.micro_batch", "2", "--parallel.pp", "auto"], 8)
    assert free == {"pp"}
    best = choice.best.layout
    assert (best.dp, best.tp, best.pp, best.zero, best.mbs, best.recompute) == (2, 2, 2, 1, 2, "none")
    assert auto.as_overrides(best, free) == ["--parallel.pp", "2"]
    ranked = search(auto.planning_config(cfg), workload_from_config(cfg), hw, DEFAULT_RUNTIME, 8).ranked
    same = [e.layout for e in ranked if (e.layout.dp, e.layout.tp, e.layout.zero, e.layout.mbs, e.layout.pp_schedule,
                                          e.layout.recompute, e.layout.sp) == (2, 2, 1, 2, "1f1b", "none", cfg.parallel.sp)]
    assert same and best == same[0]
    # train.micro_batch left unset (one micro-batch per step) would starve any pipeline: it is chosen too.
    _, _, _, choice = _choose("tiny", ["--parallel.pp", "auto"], 8)
    assert choice.free == {"pp", "mbs"} and choice.best.layout.pp == 2
    assert auto.as_overrides(choice.best.layout, choice.free)[:2] == ["--parallel.pp", "2"]


def test_split_auto_reads_both_spellings_and_leaves_other_autos_alone():
    rest, free = auto.split_auto(["--parallel.auto=true", "--parallel.tp", "2", "--parallel.backend", "auto"])
    assert rest == ["--parallel.tp", "2", "--parallel.backend", "auto"]  # backend=auto is a real value
    assert "tp" not in free and {"dp", "pp", "zero", "mbs", "recompute"} <= free
    rest, free = auto.split_auto(["--parallel.pp_schedule=auto", "--train.recompute", "auto"])
    assert rest == [] and free == {"pp_schedule", "pp_virtual", "recompute"}  # a schedule brings its stages
    assert auto.split_auto(["--parallel.auto", "false"]) == ([], frozenset())


def _error(capsys, *argv):
    assert cli.main(["train", *argv]) == 2
    return capsys.readouterr().err.strip().splitlines()


def test_bad_auto_input_is_one_sentence(capsys):
    assert _error(capsys, "tiny", "--nproc", "4", "--parallel.auto", "maybe") == [
        "error: --parallel.auto must be true or false, got 'maybe' (true lets the planner choose the layout; "
        "or give single keys the value auto, e.g. --parallel.pp auto)"]
    [line] = _error(capsys, "tiny", "--nproc", "5", "--parallel.auto", "true")
    assert line.startswith("error: --parallel.auto found no valid layout of tiny (4 layers, 4 heads, 2 kv heads, "
                           "train.global_batch=16, train.seq_len=128) on 5 ranks (")
    assert "parallel.dp=5 does not divide train.global_batch=16" in line
    [line] = _error(capsys, "tiny", "--nproc", "4", "--sweep", "2")
    assert "add --parallel.auto true" in line
    [line] = _error(capsys, "tiny", "--nproc", "8", "--parallel.auto", "true", "--model.n_layers", "80",
                    "--model.dim", "8192", "--model.ffn_dim", "28672", "--model.n_heads", "64",
                    "--model.n_kv_heads", "8", "--model.vocab_size", "128256")
    assert re.search(r"no layout of .* on 8 ranks fits the cpu profile's 16 GB per rank: the leanest", line)


def test_dry_run_prints_the_choice_the_runner_up_why_and_the_rank_map(capsys):
    assert cli.main(["train", "tiny", "--nproc", "4", "--parallel.auto", "true", "--dry-run"]) == 0
    out = capsys.readouterr().out
    _, _, _, choice = _choose("tiny", ["--parallel.auto", "true"], 4)
    best = choice.best.layout
    assert "auto layout for 4 ranks on cpu (no CUDA device" in out
    assert best.short() in out and "  runner-up: " in out and "  why: best: " in out
    assert "  by hand: " + " ".join(auto.as_overrides(best, choice.free)) in out
    assert f"layout: dp={best.dp} (zero {best.zero}) x tp={best.tp} x pp={best.pp}" in out  # the rank map


def test_sweep_keeps_the_fastest_measured_layout(capsys, monkeypatch):
    """--sweep K: the layout that measured fastest (not the predicted best) is the one launched."""
    import fivefold.plan.sweep
    import fivefold.train.launch

    speeds = iter([100.0, 300.0, 200.0])
    seen, launched = [], {}
    monkeypatch.setattr(fivefold.plan.sweep, "measure",
                        lambda cfg, layout: seen.append(cfg) or {"tokens_per_sec_per_gpu": next(speeds)})
    monkeypatch.setattr(fivefold.train.launch, "launch_local",
                        lambda path, overrides, *a, **k: launched.setdefault("overrides", overrides) and 0)
    assert cli.main(["train", "tiny", "--nproc", "4", "--parallel.auto", "true", "--sweep", "3",
                     "--checkpoint.every", "5"]) == 0
    _, _, _, choice = _choose("tiny", ["--parallel.auto", "true"], 4)
    second = auto.as_overrides(choice.valid[1].layout, choice.free)
    assert launched["overrides"][-len(second):] == second
    kept = f"kept #2, {choice.valid[1].layout.short()}: the fastest measured (300 tokens/s per rank)"
    assert kept in capsys.readouterr().out
    assert all(c.checkpoint.every == 0 for c in seen)  # the short runs never write the run's checkpoints


def test_auto_layout_really_trains(tmp_path):
    """The end-to-end path: two local ranks train the layout the planner printed."""
    run_dir = tmp_path / "auto"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "fivefold", "train", *SMALL, "--train.steps", "3",
                           "--log.dir", str(run_dir), "--nproc", "2", "--parallel.auto", "true"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    chosen = re.search(r"auto layout for 2 ranks on cpu .*: dp(\d+) tp(\d+) pp(\d+)", done.stdout)
    assert chosen, done.stdout
    dp, tp, pp = chosen.groups()
    assert re.search(rf"^layout: dp={dp} .* tp={tp} pp={pp} cp=1", done.stdout, re.MULTILINE), done.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["loss"] > 0 for r in records)
