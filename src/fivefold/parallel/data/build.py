"""Data parallelism: how gradients meet and where optimizer state lives, for each ZeRO stage.

- zero 0: every rank keeps everything; gradients are all-reduced in buckets that start while the
  backward pass is still running (ours: DDP cannot hold tensor-parallel DTensor parameters).
- zero 1 / 2: optimizer state (and, at 2, gradients) sharded over dp; see parallel/data/zero.py.
- zero 3: parameters sharded too, with PyTorch's FSDP2 `fully_shard` per transformer block.
HSDP (`dp_shard` < dp) shards inside groups of dp_shard ranks and replicates across groups.

Every variant reduces the gradients of a step once, after its last micro-batch (zero 2 instead
reduce-scatters each micro-batch, also under a pipeline, which is what keeps its gradients sharded).
"""

from __future__ import annotations

from torch import nn

from fivefold.config import Config
from fivefold.config.schedules import SPLIT_BACKWARD_SCHEDULES
from fivefold.mesh import ParallelDims
from fivefold.parallel.data.base import DataParallel
from fivefold.parallel.data.replicate import ReplicatedDataParallel


def build_data_parallel(parts: list[nn.Module], dims: ParallelDims, mesh, cfg: Config,
                        pipeline=None) -> DataParallel:
    if dims.dp * dims.cp == 1:
        if dims.expert_data_parallel > 1:
            # No data parallelism, but tp ranks holding the same experts (ep borrowing only part of
            # tp) saw different tokens: their expert gradients are partial sums to all-reduce.
            return ReplicatedDataParallel(parts, dims, mesh["dp_cp"].get_group(), mesh["edp"].get_group())
        return DataParallel(parts, dims)
    zero = cfg.parallel.zero
    if zero == 0:
        return ReplicatedDataParallel(parts, dims, mesh["dp_cp"].get_group(),
                                      mesh["edp"].get_group() if dims.ep > 1 else None)
    if zero in (1, 2):
        from fivefold.parallel.data.zero import ShardedOptimizerDataParallel

        return ShardedOptimizerDataParallel(parts, dims, mesh, shard_grads=zero == 2, pipeline=pipeline)
    from fivefold.parallel.data.fsdp import FullyShardedDataParallel

    # Schedules that split backward into an input pass and a later weight pass find the weights
    # through the stage's parameters when the input pass starts: blocks must still be unsharded then.
    split_backward = dims.pp > 1 and cfg.parallel.pp_schedule in SPLIT_BACKWARD_SCHEDULES
    return FullyShardedDataParallel(parts, dims, mesh, reshard_after_forward=not split_backward)
