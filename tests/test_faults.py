"""Surviving faults: a rank that dies is restarted from the last checkpoint (--max-restarts), a job
killed during a save resumes from the previous checkpoint, and non-finite steps are skipped and,
N in a row, stop the run with one sentence."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from layouts import reference, tiny_config

from fivefold.config import ConfigError

# The tiny model of tests/layouts.py, on the command line: 6 steps, dp2·zero1 on 2 local ranks.
ARGS = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.ffn_dim", "128", "--train.steps", "6", "--train.seq_len", "32", "--train.global_batch", "8",
        "--train.lr", "0.003", "--train.warmup", "2", "--train.seed", "3", "--data.builtin_max_bytes", "200000",
        "--log.progress", "false", "--nproc", "2", "--parallel.dp", "2", "--parallel.zero", "1",
        "--checkpoint.every", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _command(run_dir, *extra):
    return [sys.executable, "-m", "fivefold", "train", *ARGS, "--log.dir", str(run_dir), *extra]


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _uninterrupted_final_loss():
    return reference({}).losses[-1]  # layout never changes the math: the single-process run


def test_crashed_rank_is_restarted_and_the_run_finishes_with_the_same_loss(tmp_path):
    done = subprocess.run(_command(tmp_path, "--max-restarts", "1", "--debug.crash_at_step", "4",
                                   "--debug.crash_rank", "1"),
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1 crashing at step 4" in done.stdout + done.stderr
    records = _records(tmp_path)
    # Steps 3 and 4 ran twice: once before the crash (4 did not finish), once after resuming from step 2.
    assert [r["step"] for r in records][-4:] == [3, 4, 5, 6]
    assert records[-1]["loss"] == pytest.approx(_uninterrupted_final_loss(), rel=1e-5)


def test_job_killed_during_a_save_resumes_from_the_previous_checkpoint(tmp_path):
    log = open(tmp_path / "first.log", "w")  # a file, not a pipe nobody reads (it could fill and block)
    job = subprocess.Popen(_command(tmp_path, "--debug.slow_save_step", "4", "--debug.slow_save_s", "120"),
                           stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        root = tmp_path / "checkpoints"
        while not list(root.glob(".tmp-step_00000004/.metadata")):  # half-written
            assert job.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the save of step 4 never started"
            time.sleep(0.2)
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the whole job, launcher and ranks, mid-save
        job.wait()
        log.close()
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert not (root / "step_00000004").exists()

    done = subprocess.run(_command(tmp_path, "--checkpoint.resume", "auto"),
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(tmp_path)
    assert [r["step"] for r in records][-4:] == [3, 4, 5, 6]  # resumed after step 2, not from 0
    assert records[-1]["loss"] == pytest.approx(_uninterrupted_final_loss(), rel=1e-5)
    assert (root / "latest").read_text().strip() == "step_00000006"
    assert not list(root.glob(".tmp-*"))  # the killed save's leftovers are cleaned up


def _train(**debug):
    from fivefold.train.trainer import train

    return train(tiny_config({"train": {"steps": 5, "max_bad_steps": 3}, "debug": debug}))


def test_non_finite_step_is_skipped_and_logged(capsys):
    result = _train(nan_at_step=2)
    assert [r.get("skipped", False) for r in result.records] == [False, True, False, False, False]
    assert "step 2: non-finite gradient norm" in capsys.readouterr().err
    # The skipped step changed nothing: step 3 sees the weights step 2 started from, so its loss
    # differs from the uninterrupted run's, and no weight became NaN.
    assert all(r["loss"] == r["loss"] for r in result.records)


def test_too_many_non_finite_steps_in_a_row_stop_the_run():
    with pytest.raises(ConfigError, match=r"training stopped at step 4: the loss or gradient norm was not "
                                          r"finite for 3 steps in a row \(train.max_bad_steps\)"):
        _train(nan_at_step=2, nan_steps=3)


def test_collective_timeout_names_the_step(tmp_path):
    done = subprocess.run(_command(tmp_path, "--debug.hang_at_step", "2", "--debug.crash_rank", "1",
                                   "--parallel.timeout_s", "4", "--checkpoint.every", "0"),
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode != 0
    assert ("error: rank 0: a collective did not complete within parallel.timeout_s=4s during step 2; "
            "another rank died or hangs there") in done.stderr, done.stderr[-3000:]


def _report_straggler():
    import torch.distributed as dist

    from fivefold.train.faults import straggler

    return straggler(2.0 if dist.get_rank() == 1 else 0.5, torch.device("cpu"))


def test_straggler_rank_is_reported_on_every_rank():
    from ranks import run_on_ranks

    for report in run_on_ranks(2, _report_straggler):
        assert report == {"rank": 1, "step_time_s": 2.0, "median_step_time_s": 0.5}
