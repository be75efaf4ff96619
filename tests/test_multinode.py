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
