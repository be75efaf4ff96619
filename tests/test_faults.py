"""Surviving faults: a rank that dies is restarted from the last checkpoint (--max-restarts), a job
killed during a save resumes from the previous checkpoint, and non-finite steps are skipped and,
N in a row, stop the run with one sentence."""

import json
import os
import re
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
        "--train.lr", "0.003", "--train.warmup", "2", "--train.seed", "3", "--train.adam_eps", "1e-6",
        "--train.muon_ns_dtype", "fp32", "--data.builtin_max_bytes", "200000",
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


def _wait_for(job, log_path, what, ready, limit_s=240):
    deadline = time.monotonic() + limit_s
    while not ready():
        assert job.poll() is None, f"the job ended before {what}: " + log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.2)


def _stop_job(tmp_path, *extra, when, name="first"):
    """Start a job, wait until `when(run folder)`, SIGTERM its whole process group (launcher and
    ranks, as SLURM and Kubernetes do) and return (exit code, seconds from the signal to the exit, output)."""
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "w") as log:  # a file, not a pipe nobody reads (it could fill and block)
        job = subprocess.Popen(_command(tmp_path, *extra), stdout=log, stderr=subprocess.STDOUT, env=ENV,
                               start_new_session=True)
        try:
            _wait_for(job, log_path, "the moment to signal", lambda: when(tmp_path))
            os.killpg(job.pid, signal.SIGTERM)
            signalled = time.monotonic()
            code = job.wait(timeout=120)
            return code, time.monotonic() - signalled, log_path.read_text()
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()


def _steps_logged(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def test_sigterm_during_a_slow_save_leaves_the_previous_checkpoint(tmp_path):
    """The signal lands while step 4's save hangs: past checkpoint.stop_grace_s the ranks exit
    (code 75), the unfinished save is abandoned and the run continues from step 2's checkpoint."""
    root = tmp_path / "checkpoints"
    code, took, out = _stop_job(tmp_path, "--debug.slow_save_step", "4", "--debug.slow_save_s", "120",
                                "--checkpoint.stop_grace_s", "3",
                                when=lambda run: bool(list(root.glob(".tmp-step_00000004/.metadata"))))
    assert code == 75, out[-3000:]
    assert took < 3 + 30, out[-3000:]  # the grace period, and the launcher's own wait for its ranks
    assert "did not end within checkpoint.stop_grace_s=3s" in out, out[-3000:]
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert not (root / "step_00000004").exists()

    done = subprocess.run(_command(tmp_path, "--checkpoint.resume", "auto"),
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(tmp_path)
    assert [r["step"] for r in records][-4:] == [3, 4, 5, 6]  # resumed after step 2, not from 0
    assert records[-1]["loss"] == pytest.approx(_uninterrupted_final_loss(), rel=1e-5)
    assert (root / "latest").read_text().strip() == "step_00000006"
    assert not list(root.glob(".tmp-*"))  # the abandoned save's leftovers are cleaned up


def test_sigterm_to_a_four_rank_job_saves_and_it_continues_on_two_ranks(tmp_path):
    """dp2·pp2 on 4 ranks with parallel.dp = 0 (dp follows the world size) and no periodic
    checkpoints: SIGTERM after step 2 saves the step every rank agrees on and exits 75 within the
    grace period; relaunched on 2 ranks (dp1·pp2, the global batch in twice the micro-batches)
    the run ends with the uninterrupted loss."""
    layout = ["--parallel.dp", "0", "--parallel.zero", "0", "--parallel.pp", "2", "--train.micro_batch", "1",
              "--checkpoint.every", "0", "--train.steps", "12", "--debug.slow_step_s", "0.3"]
    code, took, out = _stop_job(tmp_path, "--nproc", "4", *layout, when=lambda run: len(_steps_logged(run)) >= 2)
    assert code == 75, out[-3000:]
    assert took < 25, out[-3000:]  # checkpoint.stop_grace_s
    (line,) = [line for line in out.splitlines() if line.startswith("stopped by")]  # said once
    step = _steps_logged(tmp_path)[-1]
    assert line == (f"stopped by SIGTERM at step {step}: saved the checkpoint of step {step} at "
                    f"{tmp_path}/checkpoints/step_{step:08d}; continue with checkpoint.resume=auto (exit code 75)")

    done = subprocess.run(_command(tmp_path, "--nproc", "2", *layout, "--checkpoint.resume", "auto"),
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(tmp_path)
    assert [r["step"] for r in records][step:] == list(range(step + 1, 13))
    want = reference({"train": {"steps": 12}}).losses
    assert [r["loss"] for r in records[step:]] == pytest.approx(want[step:], rel=1e-5)

    # The run's pictures: the measured bubble of pp2, and memory of 4 ranks then 2 (after the stop).
    from fivefold.tools.report import draw_report

    drawn = draw_report(tmp_path)
    assert drawn["pipeline.png"] == ["pipeline bubble (idle share of the pipeline ranks)"]
    assert set(drawn) == {"loss.png", "speed.png", "memory.png", "pipeline.png"}
    assert [len(r["peak_mem_bytes_per_rank"]) for r in records if "peak_mem_bytes_per_rank" in r] == [2]  # step 10


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
    for rank, (_, states, *_) in enumerate(two_rank_spawn):
        assert_skipped_step_changed_nothing(states, f"dp2 zero1 rank {rank}")


def test_too_many_non_finite_steps_in_a_row_stop_the_run():
    with pytest.raises(ConfigError, match=r"training stopped at step 4: the loss or gradient norm was not "
                                          r"finite for 3 steps in a row \(train.max_bad_steps\)"):
        _train(nan_at_step=2, nan_steps=3)


def test_collective_timeout_names_the_step_the_collective_and_the_rank_that_never_came(tmp_path):
    """Rank 1 stops answering as step 2 begins: rank 0's timeout names the step, and the launcher's
    diagnosis (from the flight recorders) the collective, its group and rank 1, with its stack."""
    done = subprocess.run(_command(tmp_path, "--debug.hang_at_step", "2", "--debug.crash_rank", "1",
                                   "--parallel.timeout_s", "4", "--checkpoint.every", "0"),
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode != 0
    assert ("error: rank 0: a collective did not complete within parallel.timeout_s=4s during step 2; "
            "another rank died or hangs there") in done.stderr, done.stderr[-3000:]
    hangs = tmp_path / "hangs"
    diagnosis = re.search(r"hang diagnosis: rank 0 waited in (\w+) #(\d+) of the group of ranks 0, 1 \(sizes .*\) "
                          r"during step 2; rank 1 never entered it and wrote no timeout record \(hung outside a "
                          rf"collective, or died\); where it stood: {hangs}/stack-rank1.txt; the records are in {hangs}$",
                          done.stderr, re.M)
    assert diagnosis, done.stderr[-3000:]
    record = json.loads((hangs / "rank0.json").read_text())
    last = record["entries"][-1]  # the diagnosis names rank 0's last collective of the world group
    assert (last["profiling_name"].endswith(diagnosis[1]), last["collective_seq_id"]) == (True, int(diagnosis[2]))
    assert "maybe_crash" in (hangs / "stack-rank1.txt").read_text()  # where rank 1 stood: the injected hang


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


STOPPED = {"train": {"steps": 6}, "parallel": {"dp": 2, "zero": 1}}


def _one_rank_signalled(run_dir: str):
    """Rank 1 alone receives SIGTERM as step 3 ends (checkpoint.every = 0): every rank must stop at
    step 3 with its checkpoint saved; the run continued from it gives the uninterrupted losses."""
    from fivefold.train.preemption import Stopped
    from fivefold.train.trainer import train

    settings = {**STOPPED, "log": {"dir": f"{run_dir}/stopped"}}
    try:
        train(tiny_config({**settings, "debug": {"stop_at_step": 3, "crash_rank": 1}}))
        sentence = None
    except Stopped as stop:
        sentence = stop.sentence
    resumed = train(tiny_config({**settings, "checkpoint": {"resume": "auto"}}))
    return sentence, [r["step"] for r in resumed.records], resumed.losses


def _two_ranks(run_dir: str):
    """One spawn for the 2-rank cases of this module (start-up dominates on 2 cores)."""
    return (_report_straggler(), skipped_step_states({"dp": 2, "zero": 1}), _slowed_run(run_dir),
            _one_rank_signalled(run_dir))


@pytest.fixture(scope="module")
def straggler_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("straggler")


@pytest.fixture(scope="module")
def two_rank_spawn(straggler_dir):
    from ranks import run_on_ranks

    return run_on_ranks(2, _two_ranks, str(straggler_dir))


def test_straggler_rank_is_reported_on_every_rank(two_rank_spawn):
    for report, *_ in two_rank_spawn:
        assert report == {"rank": 1, "work_s": 2.0, "median_work_s": 0.5}


def test_slowed_rank_is_named_in_a_real_run(two_rank_spawn, straggler_dir):
    """Every rank ends a step together (the gradient sync waits for the slowest), so the report
    must compare each rank's own work: step times differ only in the first step, whose start the
    ranks do not share (comparing them reports step 1 alone)."""
    for rank, (_, _, records, _) in enumerate(two_rank_spawn):
        reports = [r["straggler"] for r in records if "straggler" in r]
        later = [r["step"] for r in records[1:] if "straggler" in r]
        # A busy machine may hide the delay on a step or two (a 0.33 s stall of the other rank), not on most.
        assert len(later) >= 3, f"rank {rank}: steps 2-6 reported a straggler only at {later}"
        assert {r["rank"] for r in reports} == {SLOW_RANK}, f"rank {rank}: {reports}"
        assert all(r["work_s"] >= 0.5 > r["median_work_s"] for r in reports), reports
    written = [r.get("straggler") for r in _records(straggler_dir)]
    assert written == [r.get("straggler") for r in two_rank_spawn[0][2]]  # metrics.jsonl has them


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(two_rank_spawn, straggler_dir):
    want = reference(STOPPED).losses[3:]
    for rank, (*_, (sentence, steps, losses)) in enumerate(two_rank_spawn):
        assert sentence == (f"stopped by SIGTERM at step 3: saved the checkpoint of step 3 at "
                            f"{straggler_dir}/stopped/checkpoints/step_00000003; continue with "
                            f"checkpoint.resume=auto (exit code 75)"), f"rank {rank}: {sentence}"
        assert steps == [4, 5, 6], f"rank {rank}"
        assert losses == pytest.approx(want, rel=1e-5), f"rank {rank}"
