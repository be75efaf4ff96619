"""`fivefold plan` as the user and other tools see it: the JSON contract, the table, --layouts
order, search ranking and its explanations, and one clear sentence (exit 2) for bad input."""

from __future__ import annotations

import json

import pytest

from fivefold.plan.cli import run_plan

LLAMA8 = ["--model.preset", "llama3-8b", "--train.dtype", "bf16", "--train.seq_len", "4096",
          "--train.global_batch", "256"]
LAYOUT = "dp=8,zero=1,tp=2,pp=4,cp=1,ep=1,mbs=1,recompute=selective,pp_schedule=1f1b"


def plan(capsys, *argv):
    code = run_plan(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def plan_json(capsys, *argv):
    code, out, err = plan(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_json_follows_the_contract(capsys):
    data = plan_json(capsys, *LLAMA8, "--cluster.gpus", "64", "--cluster.gpu", "h100",
                     "--layout", LAYOUT)
    (cand,) = data["candidates"]
    # tokens_per_sec_band (issue 20), the profile and its time split (issue 41): added beside the
    # contract's fields, none of which changed
    assert set(cand) == {"layout", "fits", "memory_bytes", "step_time_s", "tokens_per_sec_per_gpu",
                         "mfu", "bubble_fraction", "comm_bytes", "why", "tokens_per_sec_band",
                         "profile", "overlaps", "time_parts_s", "memory_capacity_bytes",
                         # issue 53's goodput and cost of train.steps (names in ../shared/DESIGN.md)
                         "goodput", "checkpoint_interval_s", "train_days", "usd", "kwh"}
    # issue 53: the capacity is the device's as the driver reports it, in bytes (H100: 81,559 MiB)
    assert cand["memory_capacity_bytes"] == 81559 * 2 ** 20
    assert cand["profile"] == "fivefold-eager" and "compute" in cand["time_parts_s"]
    assert set(cand["tokens_per_sec_band"]) == {"median_rel_error", "p90_rel_error", "p90_low", "p90_high"}
    assert set(cand["memory_bytes"]) == {"params", "grads", "optimizer", "activations", "other", "total"}
    assert set(cand["comm_bytes"]) == {"dp", "tp", "pp", "cp", "ep"}
    mem = cand["memory_bytes"]
    assert mem["total"] == sum(mem[k] for k in ("params", "grads", "optimizer", "activations", "other"))
    assert cand["layout"]["tp"] == 2 and cand["layout"]["recompute"] == "selective"
    assert cand["fits"] is True and 0 < cand["mfu"] < 1
    assert cand["bubble_fraction"] == pytest.approx(3 / (32 + 3))  # pp=4, 32 micro-batches
    assert cand["comm_bytes"]["cp"] == 0 and cand["comm_bytes"]["tp"] > 0
    assert "fits with" in cand["why"]


def test_cluster_defaults_to_the_layout_world_size(capsys):
    code, out, _ = plan(capsys, *LLAMA8, "--layout", LAYOUT)
    assert code == 0 and "on 64 x h100" in out


def test_layouts_file_answers_in_input_order(capsys, tmp_path):
    lines = [{"dp": 8, "tp": 1, "mbs": 1}, {"dp": 2, "tp": 4, "zero": 1, "mbs": 4},
             {"dp": 4, "tp": 2, "recompute": "full", "mbs": 2}]
    path = tmp_path / "layouts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    data = plan_json(capsys, *LLAMA8, "--layouts", str(path))
    got = [(c["layout"]["dp"], c["layout"]["tp"], c["layout"]["mbs"]) for c in data["candidates"]]
    assert got == [(8, 1, 1), (2, 4, 4), (4, 2, 2)]
    assert data["candidates"][0]["fits"] is False  # 8B at zero 0 on 80 GB: 16 bytes/param + more
    assert "does not fit: needs" in data["candidates"][0]["why"]


def test_search_ranks_by_throughput_and_explains(capsys):
    data = plan_json(capsys, *LLAMA8, "--cluster.gpus", "64", "--top", "4")
    cands = data["candidates"]
    assert len(cands) == 4 and all(c["fits"] for c in cands)
    speeds = [c["tokens_per_sec_per_gpu"] for c in cands]
    assert speeds[0] >= max(speeds) * 0.995  # ties within 0.5% go to the leaner layout
    assert cands[0]["why"].startswith("best: ")
    assert "than" in cands[1]["why"] or cands[1]["why"].startswith("as fast as")
    assert data["rejected"] and all(r["reason"] for r in data["rejected"])
    world = {c["layout"]["dp"] * c["layout"]["tp"] * c["layout"]["pp"] * c["layout"]["cp"] for c in cands}
    assert world == {64}


def test_table_output(capsys):
    code, out, _ = plan(capsys, *LLAMA8, "--cluster.gpus", "16", "--top", "3")
    assert code == 0
    assert "tok/s/GPU" in out and "1. best:" in out and "layouts rejected" in out


def test_plot_writes_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "memory.png"
    code, _, err = plan(capsys, *LLAMA8, "--cluster.gpus", "8", "--top", "3", "--plot", str(path))
    assert code == 0, err
    assert path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv, sentence", [
    ((*LLAMA8, "--layout", "dp=8,tp=3"), "parallel.tp=3 does not divide model.n_heads=32"),
    ((*LLAMA8, "--cluster.gpus", "12"), "is not a whole number of 8-GPU nodes"),
    ((*LLAMA8, "--cluster.gpus", "8", "--cluster.gpu", "tpu"), "cluster.gpu='tpu' is not one of"),
    ((*LLAMA8, "--cluster.gpus", "8", "--cluster.fabric", "torus"), "cluster.fabric='torus' is not one of full_bisection, tapered"),
    ((*LLAMA8, "--layout", "dp=4", "--cluster.gpus", "8"), "= 4 but --cluster.gpus is 8"),
    ((*LLAMA8,), "give the cluster size with --cluster.gpus"),
    (("missing.toml",), "config file missing.toml does not exist"),
    (("--bogus", "1"), "unknown option --bogus"),
    ((*LLAMA8, "--layout", "dp=8,recompute=some"), "recompute='some' is not one of"),
    ((*LLAMA8, "--model.n_layrs", "3", "--cluster.gpus", "8"), "unknown key model.n_layrs"),
    ((*LLAMA8, "--layout", "dp=8,pp=2,mbs=1,pp_layers=10,10"), "parallel.pp_layers='10,10' adds up to 20 layers but model.n_layers=32"),
])
def test_bad_input_is_one_sentence_and_exit_2(capsys, argv, sentence):
    code, out, err = plan(capsys, *argv)
    assert code == 2 and out == ""
    assert sentence in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_cluster_fabric_is_a_config_key(capsys):
    """cluster.fabric reaches the time model: an oversubscribed fabric slows a 256-node layout's
    data-parallel reduction, a full-bisection one (the default) does not."""
    def speed(*fabric):
        data = plan_json(capsys, *LLAMA8, "--cluster.gpus", "2048", "--train.global_batch", "2048",
                         "--layout", "dp=256,tp=8,mbs=1,zero=1", *fabric)
        return data["candidates"][0]["tokens_per_sec_per_gpu"]

    assert speed() == speed("--cluster.fabric", "full_bisection")
    assert speed("--cluster.fabric", "tapered") < 0.9 * speed()


def test_bad_layouts_line_names_the_line(capsys, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"dp": 8}\n{"dp": 4 "tp": 2}\n')
    code, _, err = plan(capsys, *LLAMA8, "--layouts", str(path))
    assert code == 2 and "line 2 of --layouts is not valid JSON" in err


def test_model_that_fits_nowhere_gets_the_smallest_gpu_count(capsys):
    code, _, err = plan(capsys, "--model.preset", "llama3-405b", "--train.dtype", "bf16",
                        "--train.seq_len", "8192", "--train.global_batch", "2048",
                        "--cluster.gpus", "8")
    assert code == 2
    assert "does not fit on 8 h100 GPUs" in err
    assert "the smallest GPU count on which it fits is 128" in err


def test_chunks_without_a_layer_are_planned_and_said_to_be_planner_only(capsys):
    """Llama 3's split, scaled to 32 layers on pp 2: interleaved, one layer per chunk, the first
    chunk embedding-only and the last head-only (pp·v = 34 chunks > 32 layers)."""
    split = "0," + ",".join(["1"] * 32) + ",0"
    base = [*LLAMA8, "--cluster.gpus", "32", "--cluster.gpu", "h100"]
    layout = "dp=16,zero=1,tp=1,pp=2,mbs=1,recompute=full,pp_schedule=interleaved_1f1b,pp_virtual=17"
    (cand,) = plan_json(capsys, *base, "--layout", f"{layout},pp_layers={split}")["candidates"]
    assert "planned only" in cand["why"] and cand["layout"]["pp_virtual"] == 17
    (whole,) = plan_json(capsys, *base, "--layout", layout.replace("pp_virtual=17", "pp_virtual=16")
                         + ",pp_layers=" + ",".join(["1"] * 32))["candidates"]
    assert "planned only" not in whole["why"]
    # a split whose counts do not add up to the layers is still one sentence and exit 2
    code, _, err = plan(capsys, *base, "--layout", f"{layout},pp_layers=0," + ",".join(["1"] * 34))
    assert code == 2 and "layer" in err and err.count("\n") == 1


def test_no_valid_layout_names_the_commonest_reasons_not_only_the_first(capsys):
    """One sequence a step on 256 GPUs of llama3-8b: every layout needs pp32 (tp8 at most, no dp,
    no cp at seq 2048). 1F1B wants 32 micro-batches; the two-stage-per-rank schedules want 64
    layers. The first rejection alone named 1F1B's, the rarer of the two."""
    code, _, err = plan(capsys, "--model.preset", "llama3-8b", "--cluster.gpus", "256", "--cluster.gpu", "h100",
                        "--train.global_batch", "1", "--train.seq_len", "2048", "--parallel.dp", "1",
                        "--parallel.pp", "1", "--parallel.cp", "1")
    assert code == 2 and "no valid layout of llama3-8b exists on 256 GPUs" in err
    assert '6 of 8 layouts because "parallel.pp*pp_virtual = 64 stages exceed model.n_layers=32' in err
    assert "2 of 8 layouts because \"parallel.pp_schedule='1f1b' needs at least as many micro-batches" in err
    assert err.index("6 of 8") < err.index("2 of 8")  # the commonest first
