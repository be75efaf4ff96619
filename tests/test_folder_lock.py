"""A run owns its folders (issue 52): while one job is saving, a second job started on its run
folder or on its checkpoint root refuses in one sentence naming the first (host, pid, start) and
deletes nothing; once the first is killed, its lock is taken over with a warning and its unfinished
save is cleaned up by the job that now owns the folder."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import os
import time

from outside_the_run import TINY, Untouched, refused, train

SLOW = ["--train.steps", "3", "--checkpoint.every", "1", "--debug.slow_save_step", "2", "--debug.slow_save_s", "60"]


def _start_paused(run_dir):
    """A job paused half-way through writing its step-2 checkpoint."""
    job = subprocess.Popen([sys.executable, "-m", "fivefold", "train", *TINY, *SLOW, "--log.dir", str(run_dir)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in job.stdout:
        if line.startswith("debug: pausing"):
            return job
    job.wait()
    raise AssertionError(f"the first job never paused: {job.stderr.read()[-3000:]}")


def test_a_second_job_on_a_busy_folder_refuses_and_a_dead_jobs_lock_is_taken_over(tmp_path):
    run = tmp_path / "run"
    first = _start_paused(run)
    try:
        saving = run / "checkpoints" / ".tmp-step_00000002"
        assert saving.is_dir()
        owner = json.loads((run / ".fivefold-lock").read_text())
        assert owner["pid"] == first.pid and owner["host"] == socket.gethostname()
        who = f"pid {first.pid} on {socket.gethostname()}, started {owner['started']}"
        watch = Untouched(run, but=(".fivefold-lock",))  # the first job's folder, its save in progress included
        second = train(*SLOW[:4], "--log.dir", run, "--checkpoint.resume", "auto")
        assert refused(second) == (
            f"log.dir {run} is in use by another fivefold job ({who}): two jobs writing one folder would destroy "
            f"each other's checkpoints; wait for that job to end, or set log.dir to another folder")
        # Another run folder, the same checkpoint root: the root's own lock refuses it.
        other = train(*SLOW[:4], "--log.dir", tmp_path / "other", "--checkpoint.dir", run / "checkpoints",
                      "--checkpoint.resume", "auto")
        assert refused(other).startswith(f"checkpoint.dir {run / 'checkpoints'} is in use by another fivefold job "
                                         f"({who})")
        assert saving.is_dir()
        watch.check()  # the second jobs neither read nor wrote anything of the first's
    finally:
        first.send_signal(signal.SIGKILL)  # as a lost node: no clean-up, the lock file stays
        first.wait()
    assert json.loads((run / ".fivefold-lock").read_text())["pid"] == first.pid
    third = train(*SLOW[:4], "--log.dir", run, "--checkpoint.resume", "auto")
    assert third.returncode == 0, third.stderr[-3000:]
    assert (f"warning: took over {run / '.fivefold-lock'}, left by {who}, which is no longer running (it ended "
            "without releasing the folder)") in third.stderr
    # It continued from the dead job's step 1 and redid step 2, whose half-save it cleaned up first.
    assert "saved step 1 " not in third.stdout and "saved step 2 " in third.stdout and not saving.exists()
    assert not (run / ".fivefold-lock").exists()  # a job that ends lets go of its folders
