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


def _training_state(par, optimizer) -> dict:
    """Everything an update changes, as this rank holds it: its weights (local shards), the tensors
    its optimizer updates (ZeRO: its chunks of the flat buckets) and their AdamW state (exp_avg,
    exp_avg_sq, step), and the persistent buffers (MoE balancing biases)."""
    import copy

    from torch.distributed.tensor import DTensor

    from fivefold.parallel.pieces import persistent_buffers

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()
    return {"weights": {n: local(p) for part in par.parts for n, p in part.named_parameters()},
            "owned": [local(p) for group in optimizer.param_groups for p in group["params"]],
            "moments": copy.deepcopy(optimizer.state_dict()["state"]),
            "buffers": {n: local(b) for n, b in persistent_buffers(par).items()}}


def skipped_step_states(parallel: dict | None = None) -> list[dict]:
    """Train 3 steps with step 2's gradient norm made NaN; the training state just before and just
    after each update that ran (steps 1 and 3)."""
    from fivefold.parallel.parallelized import Parallelized
    from fivefold.train.trainer import train

    states, original = [], Parallelized.optimizer_step

    def optimizer_step(self, optimizer):
        states.append(_training_state(self, optimizer))
        original(self, optimizer)
        states.append(_training_state(self, optimizer))
    Parallelized.optimizer_step = optimizer_step
    try:
        result = train(tiny_config({"train": {"steps": 3}, "parallel": parallel or {}, "debug": {"nan_at_step": 2}}))
    finally:
        Parallelized.optimizer_step = original
    assert [r.get("skipped", False) for r in result.records] == [False, True, False]
    return states


def assert_skipped_step_changed_nothing(states: list[dict], label: str = "") -> None:
    assert len(states) == 4, f"{label}: {len(states) // 2} updates ran, want 2 (steps 1 and 3)"
    before_1, after_1, before_3, _ = states
    moments = after_1["moments"]
    assert moments and all(set(m) >= {"exp_avg", "exp_avg_sq", "step"} for m in moments.values()), label
    assert all(float(m["step"]) == 1 for m in moments.values()), label
    # Step 1's update really moved the weights, so comparing against it can fail.
    assert any(not torch.equal(a, b) for a, b in zip(before_1["owned"], after_1["owned"])), label
    for what in ("weights", "buffers"):
        for name, tensor in after_1[what].items():
            assert torch.equal(tensor, before_3[what][name]), f"{label}: the skipped step changed {name}"
    for i, (a, b) in enumerate(zip(after_1["owned"], before_3["owned"])):
        assert torch.equal(a, b), f"{label}: the skipped step changed optimizer tensor {i}"
    assert moments.keys() == before_3["moments"].keys(), label
    for index, state in moments.items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(before_3["moments"][index][key])), \
                f"{label}: the skipped step changed the optimizer's {key} of tensor {index}"


def test_non_finite_step_is_skipped_and_logged(capsys):
    result = _train(nan_at_step=2)
    assert [r.get("skipped", False) for r in result.records] == [False, True, False, False, False]
    assert "step 2: non-finite gradient norm" in capsys.readouterr().err
    assert all(r["loss"] == r["loss"] for r in result.records)  # no weight became NaN


def test_skipped_step_leaves_weights_and_adamw_moments_alone():
    assert_skipped_step_changed_nothing(skipped_step_states(), "one process")


def test_skipped_step_under_zero1_leaves_each_ranks_chunks_alone(two_rank_spawn):
    for rank, (_, states, _) in enumerate(two_rank_spawn):
        assert_skipped_step_changed_nothing(states, f"dp2 zero1 rank {rank}")


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


SLOW_RANK = 1  # not 0: the report must find the rank, not fall back to the first


def _slowed_run(run_dir: str) -> list[dict]:
    """dp2 zero1 for 6 steps with one rank 0.5 s slower on every step (a tiny step takes ~0.05 s alone)."""
    from fivefold.train.trainer import train

    result = train(tiny_config({"train": {"steps": 6}, "parallel": {"dp": 2, "zero": 1},
                                "log": {"every": 1, "dir": run_dir},
                                "debug": {"slow_step_s": 0.5, "crash_rank": SLOW_RANK}}))
    return result.records


def _two_ranks(run_dir: str):
    """One spawn for the 2-rank cases of this module (start-up dominates on 2 cores)."""
    return _report_straggler(), skipped_step_states({"dp": 2, "zero": 1}), _slowed_run(run_dir)


@pytest.fixture(scope="module")
def straggler_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("straggler")


@pytest.fixture(scope="module")
def two_rank_spawn(straggler_dir):
    from ranks import run_on_ranks

    return run_on_ranks(2, _two_ranks, str(straggler_dir))


def test_straggler_rank_is_reported_on_every_rank(two_rank_spawn):
    for report, _, _ in two_rank_spawn:
        assert report == {"rank": 1, "work_s": 2.0, "median_work_s": 0.5}


def test_slowed_rank_is_named_in_a_real_run(two_rank_spawn, straggler_dir):
    """Every rank ends a step together (the gradient sync waits for the slowest), so the report
    must compare each rank's own work: step times differ only in the first step, whose start the
    ranks do not share (comparing them reports step 1 alone)."""
    for rank, (_, _, records) in enumerate(two_rank_spawn):
        reports = [r["straggler"] for r in records if "straggler" in r]
        later = [r["step"] for r in records[1:] if "straggler" in r]
        # A busy machine may hide the delay on a step or two (a 0.33 s stall of the other rank), not on most.
        assert len(later) >= 3, f"rank {rank}: steps 2-6 reported a straggler only at {later}"
        assert {r["rank"] for r in reports} == {SLOW_RANK}, f"rank {rank}: {reports}"
        assert all(r["work_s"] >= 0.5 > r["median_work_s"] for r in reports), reports
    written = [r.get("straggler") for r in _records(straggler_dir)]
    assert written == [r.get("straggler") for r in two_rank_spawn[0][2]]  # metrics.jsonl has them
