"""A launch that cannot form its job ends in one sentence with the fix, on each launch path (issue
52): fivefold's launcher on several nodes (`--rdzv` port taken, a node that never joins) and a rank
started the torchrun way (RANK, MASTER_ADDR, MASTER_PORT set: the port taken). These used to end
in torch elastic's traceback."""

from __future__ import annotations

import socket

import pytest
from outside_the_run import refused, train

DP2 = ["--parallel.dp", "2", "--train.steps", "1"]


@pytest.fixture
def taken_port():
    """A port another process listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rendezvous_port_in_use(tmp_path, taken_port):
    said = refused(train(*DP2, "--nproc", "1", "--nnodes", "2", "--node-rank", "0", "--rdzv",
                         f"127.0.0.1:{taken_port}", "--log.dir", tmp_path / "run"))
    assert said == (f"the rendezvous port {taken_port} of --rdzv 127.0.0.1:{taken_port} is already in use on this "
                    "machine (another job, or an earlier launcher that has not exited, holds it); choose a free port "
                    f"for --rdzv (the same on every node) or end the process that holds it (`ss -ltnp | grep "
                    f":{taken_port}` shows it)")


def test_a_rank_started_the_torchrun_way_on_a_port_in_use(tmp_path, taken_port):
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(taken_port)}
    said = refused(train(*DP2, "--log.dir", tmp_path / "run", env=env))
    assert said.startswith(f"the rendezvous port {taken_port} of MASTER_ADDR:MASTER_PORT 127.0.0.1:{taken_port} is "
                           "already in use on this machine"), said


def test_a_node_that_never_joins(tmp_path):
    port = _free_port()
    said = refused(train(*DP2, "--nproc", "1", "--nnodes", "2", "--node-rank", "0", "--rdzv", f"127.0.0.1:{port}",
                         "--parallel.timeout_s", "4", "--log.dir", tmp_path / "run"), code=3)
    assert said == (f"not every node joined the rendezvous at --rdzv 127.0.0.1:{port} within 4 s (2 expected); start "
                    "the same command on each node with its own --node-rank and the same --rdzv, check that every "
                    f"node can reach 127.0.0.1:{port}, or raise parallel.timeout_s if the nodes start far apart")
