"""Data parallelism: how gradients meet and where optimizer state lives, for each ZeRO stage.

- zero 0: every rank keeps everything; gradients are all-reduced in buckets that start while the
  backward pass is still running (ours: DDP cannot hold tensor-parallel DTensor parameters).
- zero 1 / 2: optimizer state (and, at 2, gradients) sharded over dp; see parallel/data/zero.py.
- zero 3: parameters sharded too, with PyTorch's FSDP2 `fully_shard` per transformer block.
HSDP (`dp_shard` < dp) shards inside groups of dp_shard ranks and replicates across groups.

Every variant reduces the gradients of a step once, after its last micro-batch (zero 2 instead
reduce-scatters each micro-batch, also under a pipeline, which is what keeps its gradients sharded).

Under `train.dtype = bf16` the parameters are bf16 and the fp32 master weights live with the
optimizer: zero 0/1/2 and a layout without data parallelism all run parallel/data/zero.py, which
keeps the masters (whole, or its chunk) and accumulates gradients in fp32; zero 3 gives FSDP2 a
mixed-precision policy (bf16 gathers, fp32 reduce-scatter, fp32 shards).
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
    dp = _build(parts, dims, mesh, cfg, pipeline, settings := optimizer_settings(cfg))
    dp.set_settings(settings)
    return dp


def optimizer_settings(cfg: Config) -> dict:
    """Each parameter's optimizer settings by single-device name (config/param_groups.py)."""
    from fivefold.models.param_settings import settings_by_name
    from fivefold.models import build_meta_model

    return settings_by_name(cfg.train, build_meta_model(cfg.model, cfg.lora))


def _build(parts, dims, mesh, cfg: Config, pipeline, settings: dict) -> DataParallel:
    zero = cfg.parallel.zero
    fsdp = zero == 3 and dims.dp * dims.cp > 1
    if cfg.train.dtype == "bf16" and not fsdp:
        from fivefold.parallel.data.zero import ShardedOptimizerDataParallel

        sharded = zero in (1, 2) and dims.dp * dims.cp > 1
        return ShardedOptimizerDataParallel(parts, dims, mesh, shard_grads=sharded and zero == 2, pipeline=pipeline,
                                            main_grads=not (sharded and zero == 2), shard=sharded,
                                            settings=settings)
    if dims.dp * dims.cp == 1:
        if dims.expert_data_parallel > 1:
            # No data parallelism, but tp ranks holding the same experts (ep borrowing only part of
            # tp) saw different tokens: their expert gradients are partial sums to all-reduce.
            return ReplicatedDataParallel(parts, dims, mesh["dp_cp"].get_group(), mesh["edp"].get_group())
        return DataParallel(parts, dims)
    if zero == 0:
        return ReplicatedDataParallel(parts, dims, mesh["dp_cp"].get_group(),
                                      mesh["edp"].get_group() if dims.ep > 1 else None)
    if zero in (1, 2):
        from fivefold.parallel.data.zero import ShardedOptimizerDataParallel

        return ShardedOptimizerDataParallel(parts, dims, mesh, shard_grads=zero == 2, pipeline=pipeline,
                                            settings=settings)
    from fivefold.parallel.data.fsdp import FullyShardedDataParallel

    # Schedules that split backward into an input pass and a later weight pass find the weights
    # through the stage's parameters when the input pass starts: blocks must still be unsharded then.
    split_backward = dims.pp > 1 and cfg.parallel.pp_schedule in SPLIT_BACKWARD_SCHEDULES
    return FullyShardedDataParallel(parts, dims, mesh, reshard_after_forward=not split_backward,
                                    bf16=cfg.train.dtype == "bf16")
