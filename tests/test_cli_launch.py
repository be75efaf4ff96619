"""The user's path: `fivefold train ... --nproc N` launches ranks itself and writes metrics.jsonl."""

import json
import os
import subprocess
import sys

import pytest

ARGS = ["--model.dim", "64", "--model.n_layers", "2", "--model.ffn_dim", "128", "--train.steps", "4",
        "--train.seq_len", "32", "--train.global_batch", "8", "--data.builtin_max_bytes", "200000",
        "--log.every", "1"]


def _run(tmp_path, name, *extra):
    run_dir = tmp_path / name
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "fivefold", "train", *ARGS, "--log.dir", str(run_dir), *extra],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], done.stdout


def test_four_local_ranks_write_the_single_process_losses(tmp_path):
    single, _ = _run(tmp_path, "single")
    parallel, stdout = _run(tmp_path, "dp2tp2", "--nproc", "4", "--parallel.dp", "2", "--parallel.tp", "2",
                            "--parallel.zero", "1")
    assert "layout: dp=2" in stdout and "tp=2" in stdout
    assert len(parallel) == len(single) == 4
    for a, b in zip(parallel, single):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_sec", "tokens_per_sec_per_gpu", "mfu", "step_time_s",
                "peak_mem_bytes"):
        assert key in parallel[-1]
    assert parallel[-1]["comm_bytes"]["dp"] > 0 and parallel[-1]["comm_bytes"]["tp"] > 0


def test_bad_layout_is_refused_before_any_rank_starts(tmp_path):
    done = subprocess.run([sys.executable, "-m", "fivefold", "train", *ARGS, "--nproc", "4", "--parallel.tp", "3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: parallel.dp*tp*pp*cp = 1*3*1*1 = 3 but the job has 4 ranks; make the degrees multiply to 4"]
