"""Preemption: a signal becomes a checkpoint of one step that every rank agrees on, then an exit.

Clusters end jobs with a signal and a deadline: SLURM (`scancel`, `--signal=USR1@60`), Kubernetes
and spot instances send SIGTERM (or SIGUSR1) to every process and SIGKILL some seconds later. A
rank that receives SIGTERM, SIGUSR1 or SIGINT only raises a flag; at each step boundary the ranks
all-reduce their flags (one scalar, so a signal that reached one rank stops all of them at the
same step, and no rank saves alone or waits for a peer that already left), save the checkpoint of
that step and exit with EXIT_CODE. A signal that arrives during a save lets the save finish (the
atomic rename in checkpoint/save_load.py means an unfinished save never touches the previous one).
If the step and the save do not end within `checkpoint.stop_grace_s` of the signal, the rank
exits anyway: the last complete checkpoint is what the next `resume = auto` reads.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch.distributed as dist

from fivefold.parallel.collectives import all_reduce_scalars

EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): stopped on request, continue later with resume = auto
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Stopped(Exception):
    """The run stopped on a signal after saving the checkpoint of `step` (at `path`)."""

    def __init__(self, sentence: str):
        super().__init__(sentence)
        self.sentence = sentence


def stopped_sentence(signum: int, step: int, path) -> str:
    where = f"saved the checkpoint of step {step} at {path}" if path else f"no checkpoint folder is set (log.dir or checkpoint.dir), nothing was saved after step {step}"
    return (f"stopped by {signal.Signals(signum).name} at step {step}: {where}; continue with "
            f"checkpoint.resume=auto (exit code {EXIT_CODE})")


class StopRequests:
    """Within `with StopRequests(...) as stops:` the stop signals raise a flag instead of killing
    the process; `stops.agreed(device)` at a step boundary tells every rank the same answer.

    Python runs a signal handler only when the main thread returns to the interpreter, which a
    rank blocked in a collective (waiting for a peer that is saving) may not do for minutes. The
    signal also writes its number to a wake-up pipe at once, from C; a watcher thread reads it and
    starts the grace period, so the deadline holds wherever the main thread is."""

    def __init__(self, grace_s: float, rank: int, job_failed=lambda: False):
        self.grace_s = grace_s
        self.rank = rank
        self.job_failed = job_failed  # True when the signal is the launcher ending a failed job
        self.signum = 0  # the first stop signal received here; 0 = none
        self._previous: dict[int, object] = {}
        self._previous_wakeup = -1
        self._pipe: tuple[int, int] | None = None
        self._deadline: threading.Timer | None = None

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only: nothing to catch here
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._pipe = (read, write)
        self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, lambda *_: None)  # the watcher does the work
        threading.Thread(target=self._watch, args=(read,), name="stop-signal-watcher", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._pipe is None:
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_wakeup)
        if self._deadline is not None:
            self._deadline.cancel()
        os.close(self._pipe[1])  # ends the watcher's read
        self._pipe = None

    def _watch(self, read: int) -> None:
        while True:
            try:
                data = os.read(read, 64)
            except OSError:
                data = b""
            if not data:
                os.close(read)
                return
            for signum in data:
                if signum in SIGNALS and self.job_failed():  # nothing to save for: a peer is gone
                    os._exit(128 + signum)
                if signum in SIGNALS and not self.signum:  # later ones (the launcher forwarding) share the first's grace
                    self.signum = signum
                    self._deadline = threading.Timer(self.grace_s, self._out_of_time)
                    self._deadline.daemon = True
                    self._deadline.start()

    def _out_of_time(self) -> None:
        if self.rank == 0:
            print(f"error: stopped by {signal.Signals(self.signum).name}: the step and its checkpoint did not end "
                  f"within checkpoint.stop_grace_s={self.grace_s:g}s; the last complete checkpoint is where "
                  f"checkpoint.resume=auto continues (exit code {EXIT_CODE})", file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)  # the main thread may be inside a collective: no clean way out of it

    def agreed(self, device) -> int:
        """The stop signal if any rank has received one, else 0: the same on every rank (collective)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.signum
        received = all_reduce_scalars([float(self.signum == sig) for sig in SIGNALS], None, device)
        return next((int(sig) for sig, n in zip(SIGNALS, received.tolist()) if n), 0)


    def inject(self, debug, step: int, rank: int) -> None:
        """Test-only ([debug] stop_at_step): rank `debug.crash_rank` sends itself `debug.stop_signal`
        as step `debug.stop_at_step` ends, as a scheduler would, and waits for its watcher to see it."""
        if debug.stop_at_step != step or rank != debug.crash_rank:
            return
        signal.raise_signal(getattr(signal, debug.stop_signal))
        for _ in range(200):
            if self.signum or self._pipe is None:
                return
            time.sleep(0.01)
