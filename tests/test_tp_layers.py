"""The tensor-parallel block collectives (parallel/tensor/layers.py) against the whole tensors they stand
for, forward and backward, on 2 and 4 gloo ranks: with and without sequence parallelism, and with both
reduce-scatters (the all-to-all one gloo uses, and the native one NCCL uses, which gloo also runs)."""

from __future__ import annotations

import pytest
import torch

from ranks import run_on_ranks

BATCH, SEQ, DIM = 3, 8, 5


def check_collectives() -> list[str]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fivefold.parallel.tensor.layers import TensorParallelGroup

    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
    local = SEQ // size
    mine = slice(rank * local, (rank + 1) * local)
    generator = torch.Generator().manual_seed(0)  # the same draws on every rank
    whole = torch.randn(BATCH, SEQ, DIM, generator=generator)
    partials = torch.randn(size, BATCH, SEQ, DIM, generator=generator)  # rank r's partial sums
    weights = torch.randn(size, BATCH, SEQ, DIM, generator=generator)  # rank r's loss weights
    checked = []
    for all_to_all in (True, False):
        group = TensorParallelGroup(mesh["tp"], sequence_parallel=True)
        group.scatter_by_all_to_all = all_to_all
        label = f"sp all_to_all={all_to_all}"

        # Sequence parallel: rank r holds positions `mine`; each rank's loss reads the gathered
        # sequence through its own weights, and the objective is the sum over ranks.
        x = whole[:, mine].clone().requires_grad_()
        gathered = group.gather_sequence(x)
        torch.testing.assert_close(gathered, whole, msg=label)
        (gathered * weights[rank]).sum().backward()
        torch.testing.assert_close(x.grad, weights.sum(0)[:, mine], msg=label)

        partial = partials[rank].clone().requires_grad_()
        scattered = group.scatter_sequence(partial)
        torch.testing.assert_close(scattered, partials.sum(0)[:, mine], msg=label)
        (scattered * weights[rank][:, mine]).sum().backward()
        each_ranks_weights = [weights[r][:, r * local:(r + 1) * local] for r in range(size)]
        torch.testing.assert_close(partial.grad, torch.cat(each_ranks_weights, dim=1), msg=label)

        # Token order: the same values, rank-major along dim 0, no re-ordering.
        x = whole[:, mine].clone().requires_grad_()
        tokens = group.gather_tokens(x)
        pieces = [whole[:, r * local:(r + 1) * local] for r in range(size)]
        torch.testing.assert_close(tokens, torch.cat(pieces), msg=label)
        rank_major = weights[:, :, :local].reshape(size * BATCH, local, DIM)  # rank r's weights, by rank
        (tokens * rank_major).sum().backward()
        torch.testing.assert_close(x.grad, rank_major.view(size, BATCH, local, DIM)[rank] * size, msg=label)

        partial = partials[rank][:, :local].repeat(size, 1, 1)  # chunk r of every rank goes to rank r
        torch.testing.assert_close(group.scatter_tokens(partial), partials[:, :, :local].sum(0), msg=label)
        checked.append(label)

    # Without sequence parallelism the stream is whole on every rank and counted once: the gather
    # sums gradients (each rank's columns), the scatter sums values and passes gradients through.
    group = TensorParallelGroup(mesh["tp"], sequence_parallel=False)
    x = whole.clone().requires_grad_()
    same = group.gather_sequence(x)
    torch.testing.assert_close(same, whole)
    (same * weights[rank]).sum().backward()
    torch.testing.assert_close(x.grad, weights.sum(0))
    partial = partials[rank].clone().requires_grad_()
    summed = group.scatter_sequence(partial)
    torch.testing.assert_close(summed, partials.sum(0))
    (summed * weights[0]).sum().backward()
    torch.testing.assert_close(partial.grad, weights[0])
    checked.append("no sp")
    return checked


@pytest.mark.parametrize("world_size", [2, 4])
def test_block_collectives_match_whole_tensors(world_size):
    for checked in run_on_ranks(world_size, check_collectives):
        assert checked == ["sp all_to_all=True", "sp all_to_all=False", "no sp"]
