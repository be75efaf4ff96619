"""Two "nodes" on loopback: two `fivefold train --nnodes 2 --node-rank R --rdzv 127.0.0.1:PORT`
launchers of 2 ranks each meet through torch's c10d rendezvous and train dp2 x tp2 as one 4-rank
job, every tp group inside one launcher (node), and match the single-process run. This is what
`torchrun --nnodes 2 ...` or SLURM does on two machines; only the address differs."""

import json
import os
import socket
import subprocess
import sys

from layouts import BASE, reference

LAYOUT = {"parallel": {"dp": 2, "tp": 2}}


def _cli_overrides() -> list[str]:
    """The tests' tiny config (layouts.BASE) as command-line overrides."""
    out = []
    for section, values in BASE.items():
        for key, value in values.items():
            out += [f"--{section}.{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launchers_match_the_single_process_run(tmp_path):
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = [sys.executable, "-m", "fivefold", "train", "--nproc", "2", "--nnodes", "2",
              "--rdzv", f"127.0.0.1:{port}", "--rdzv-id", f"test{port}", *_cli_overrides(),
              "--parallel.dp", "2", "--parallel.tp", "2", "--log.dir", str(tmp_path)]
    # Node 1 first: it waits at the rendezvous for node 0, which hosts the store.
    launchers = [subprocess.Popen([*common, "--node-rank", str(r)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env) for r in (1, 0)]
    outputs = []
    try:
        for p in launchers:
            out, err = p.communicate(timeout=300)
            outputs.append((p.returncode, out, err))
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
    for rc, _, err in outputs:
        assert rc == 0, err[-3000:]
    _, node0_out, _ = outputs[1]
    # The launch's rank map: tp groups are a launcher's own ranks; dp goes across the two nodes.
    assert "2 ranks per node -> 2 node(s)" in node0_out
    assert "tp    2 ranks, all inside one node: [0,1] [2,3]" in node0_out
    assert "dp    2 ranks, 2 of 2 cross nodes: *[0,2] *[1,3]" in node0_out
    assert all("spans nodes" not in err for _, _, err in outputs)  # the trainer's own tp check
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    want = reference(LAYOUT)
    assert len(records) == len(want.losses)
    for r, loss, norm in zip(records, want.losses, want.grad_norms):
        assert abs(r["loss"] - loss) <= 1e-5 * abs(loss), (r["step"], r["loss"], loss)
        assert abs(r["grad_norm"] - norm) <= 1e-5 * abs(norm), (r["step"], r["grad_norm"], norm)


def _descendants(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid] + [q for child in children for q in _descendants(int(child))]


def test_torchrun_elastic_continues_on_the_node_that_is_left(tmp_path):
    """torchrun --nnodes 1:2 on two loopback "nodes" of 2 ranks, parallel.dp = 0 (dp4): once step 2's
    checkpoint exists, node B (its agent and workers) is killed for good. Node A's ranks lose
    contact, its agent restarts them at the next rendezvous with one node, dp follows the world
    size (dp2), the run resumes from the newest checkpoint and ends with the single-process run's
    losses (global batch kept by the micro-batch count)."""
    import signal
    import time

    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def command(is_host: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"elastic{port}",
                "--max-restarts", "1", "--rdzv-conf", f"join_timeout=120,last_call_timeout=3,is_host={is_host}",
                "-m", "fivefold", "train", *_cli_overrides(), "--parallel.dp", "0", "--log.dir", str(tmp_path),
                "--checkpoint.every", "2", "--parallel.timeout_s", "30", "--log.progress", "true",
                # steps of a second (first attempt only), so the kill lands inside the run
                "--debug.slow_step_s", "1.0", "--debug.crash_rank", "0"]

    # A hosts the rendezvous store (it must outlive B). B starts first and waits for the store, so it
    # joins the moment A opens it: had B started second, a loaded machine could delay its join past
    # the 3 s last call, and A would start a 1-node world alone (seen beside another pytest worker).
    b_log = tmp_path / "node_b.log"
    with b_log.open("w") as b_out:
        b = subprocess.Popen(command("false"), stdout=b_out, stderr=subprocess.STDOUT, env=env)
    a = subprocess.Popen(command("true"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    latest = tmp_path / "checkpoints" / "latest"
    try:
        deadline = time.time() + 240
        while not (latest.is_file() and latest.read_text().strip() >= "step_00000002"):
            assert time.time() < deadline and a.poll() is None, "the job ended or stalled before its first checkpoint"
            time.sleep(0.1)
        for pid in _descendants(b.pid):  # a node lost: torch elastic starts each worker in its own session
            os.kill(pid, signal.SIGKILL)
        out, _ = a.communicate(timeout=300)
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
    assert a.returncode == 0, out[-3000:]
    # The world shrank and dp with it (the 4-rank world's rank 0 may have been on either node).
    assert "layout: dp=4" in out + b_log.read_text() and "layout: dp=2" in out, out[-3000:]
    assert "resumed from" in out
    by_step = {}
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record  # steps after the checkpoint ran twice: the resumed run's count
    want = reference({})
    assert sorted(by_step) == list(range(1, len(want.losses) + 1))
    for step, loss in enumerate(want.losses, 1):
        assert abs(by_step[step]["loss"] - loss) <= 1e-5 * abs(loss), (step, by_step[step]["loss"], loss)
