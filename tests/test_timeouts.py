"""A rank that stops answering ends the job with an error, never a hang."""

import time

import pytest

from ranks import run_on_ranks


def _one_rank_goes_silent():
    import torch
    import torch.distributed as dist

    from fivefold.config import ParallelConfig
    from fivefold.mesh import ParallelDims

    meshes = ParallelDims.from_config(ParallelConfig(dp=2)).build_mesh("cpu")
    if dist.get_rank() == 1:
        time.sleep(15)  # alive but silent: no error from the network, only the timeout can end it
        return "slept"
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=meshes["dp_cp"].get_group())  # a sub-mesh group
    except RuntimeError as err:
        return ("error", time.monotonic() - start, str(err)[:200])
    return ("no error", time.monotonic() - start, "")


def test_collective_on_a_mesh_group_times_out():
    results = run_on_ranks(2, _one_rank_goes_silent, timeout_s=120, collective_timeout_s=5)
    outcome, waited, message = results[0]
    assert outcome == "error", message
    # Without the 5 s timeout rank 0 would wait at least until rank 1 wakes and leaves.
    assert waited < 12, f"took {waited:.0f}s: the mesh group did not inherit the 5 s timeout"


def _one_rank_is_killed():
    import os
    import signal

    import torch
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer does: no traceback
    dist.all_reduce(torch.ones(4))  # rank 0: "connection closed by peer", the echo of rank 1's death
    return "finished"


def test_the_harness_names_the_rank_that_died_first():
    """tests/ranks.py reports the cause (rank 1 killed), not the first message (rank 0's broken
    connection), as a 16-rank spawn in CI once did."""
    with pytest.raises(AssertionError) as failure:
        run_on_ranks(2, _one_rank_is_killed, timeout_s=120, collective_timeout_s=20)
    report = str(failure.value)
    assert report.startswith("rank 1 died first, killed by SIGKILL"), report
    assert "rank 0:" in report, report  # the echo is listed after the cause
