"""`fivefold train CONFIG --nproc N --ft.replicas R` on one machine: a torchft lighthouse in this
process, and R replica groups, each its own `fivefold train --nproc N --ft.group G` job. A group
that dies is started again (up to `--max-restarts` times each, 3 when not given) and heals from a
live group; the others go on without it meanwhile. The job succeeds when every group has trained
the last step; it fails when a group fails past its restarts, or no group is left alive.

Each group's output reaches this console prefixed `[group G]`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from fivefold.config import Config, ConfigError
from fivefold.ft import need
from fivefold.ft.group import ATTEMPT_ENV
from fivefold.train.launch import launched_by_torchrun, signal_name

DEFAULT_RESTARTS = 3


def run_replica_groups(config_path: str | None, overrides: list[str], nproc: int, cfg: Config,
                       max_restarts: int = 0, nnodes: int = 1) -> int:
    if launched_by_torchrun() or nnodes > 1:
        raise ConfigError("ft.replicas under torchrun or --nnodes makes each replica group its own job: start a "
                          "lighthouse (torchft_lighthouse --min_replicas 1) and give every group --ft.lighthouse "
                          "HOST:PORT and its --ft.group G")
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's quorum chatter at every step; RUST_LOG=info shows it
    need.torchft()
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=cfg.ft.min_replicas)
    address = lighthouse.address()
    print(f"torchft lighthouse at {address}: {cfg.ft.replicas} replica groups of {nproc} rank(s), "
          f"ft.mode={cfg.ft.mode}", flush=True)
    restarts_each = max_restarts or DEFAULT_RESTARTS
    command = [sys.executable, "-m", "fivefold", "train", *([config_path] if config_path else []),
               "--nproc", str(nproc), *overrides, "--ft.lighthouse", address]
    groups = {g: _Group(g, command) for g in range(cfg.ft.replicas)}
    try:
        for group in groups.values():
            group.start()
        while True:
            time.sleep(0.2)
            codes = {g: group.process.poll() for g, group in groups.items()}
            finished = any(code == 0 for code in codes.values())  # some group trained the last step
            if all(code is not None for code in codes.values()) and finished:
                return 0
            for g, code in codes.items():
                if code in (None, 0) or groups[g].given_up:
                    continue
                why = _exit_text(code)
                if finished:  # the job's steps are trained: nothing left to heal into
                    groups[g].given_up = True
                    print(f"replica group {g} {why} after another group trained the last step; it is not "
                          "started again", file=sys.stderr, flush=True)
                    continue
                alive = any(c is None for h, c in codes.items() if h != g)
                if not alive or groups[g].restarts >= restarts_each:
                    reason = ("no other group is alive to heal it from" if not alive else
                              f"it was started again {groups[g].restarts} times already (--max-restarts)")
                    print(f"error: replica group {g} {why}, and {reason}; the job stopped", file=sys.stderr,
                          flush=True)
                    return code if code > 0 else 1
                groups[g].restarts += 1
                print(f"replica group {g} {why}; the other groups go on without it; starting it again "
                      f"({groups[g].restarts} of {restarts_each}), it heals from a live group", file=sys.stderr,
                      flush=True)
                groups[g].start()
    finally:
        for group in groups.values():
            group.stop()
        lighthouse.shutdown()


class _Group:
    """One replica group's process, started again by `start`, its output prefixed on this console."""

    def __init__(self, group: int, command: list[str]):
        self.group, self.command, self.restarts = group, [*command, "--ft.group", str(group)], 0
        self.process: subprocess.Popen | None = None
        self.given_up = False

    def start(self) -> None:
        env = {**os.environ, ATTEMPT_ENV: str(self.restarts)}
        self.process = subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # its own process group: stopped as one
        self.relay = threading.Thread(target=self._relay, args=(self.process.stdout,), daemon=True)
        self.relay.start()

    def _relay(self, stream) -> None:
        prefix = f"[group {self.group}] "
        for line in iter(stream.readline, b""):
            sys.stdout.write(prefix + line.decode(errors="replace"))
            sys.stdout.flush()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
        if self.process is not None:
            self.relay.join(timeout=10)  # its last lines reach the console before the job's verdict


def _exit_text(code: int) -> str:
    if code < 0:
        return f"was killed by {signal_name(code)}"
    return f"exited with code {code}"
