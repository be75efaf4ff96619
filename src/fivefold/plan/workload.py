"""What is being trained, independent of the layout: model statistics, sequence length, global
batch, the precision recipe (bytes per parameter for each piece of model state), and where mesh
dimensions sit (parallel.order)."""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.plan.model_stats import ModelStats, model_stats


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each piece of model state (Rajbhandari et al. 2019, ZeRO)."""
    name: str
    param_bytes: int  # weights as stored (sharded at ZeRO-3)
    grad_bytes: int  # gradients (sharded at ZeRO-2)
    accum_bytes: int  # a separate fp32 gradient accumulation buffer (sharded at ZeRO-2)
    optim_bytes: int  # optimizer state: Adam moments, plus any fp32 master copy (ZeRO-1)
    reduce_bytes: int  # bytes per element of the data-parallel gradient reduction
    act_bytes: int  # bytes per activation element
    shard_master_bytes: int = 0  # fp32 master of the owned chunk, kept only at ZeRO-1/2
    cast_bytes: int = 0  # compute-dtype weight copies autocast keeps for backward


PRECISIONS = {
    # fivefold's trainer: fp32 weights under bf16 autocast. Weights 4 + gradients 4 + Adam 8 = 16;
    # ZeRO-1/2 also keep an fp32 master of their chunk (parallel/data/zero.py); autocast keeps bf16
    # copies of the weights for backward. Gradients are reduced in fp32.
    "bf16": Precision("bf16", 4, 4, 0, 8, 4, 2, shard_master_bytes=4, cast_bytes=2),
    # Megatron / nanotron (the Playbook's runs): bf16 weights 2 + bf16 gradients 2 + fp32
    # gradient accumulation buffer 4 + fp32 master and Adam moments 12 = 20.
    "bf16_fp32_accum": Precision("bf16_fp32_accum", 2, 2, 4, 12, 4, 2),
    # Everything in fp32: weights 4, gradients 4, Adam moments 8 (ZeRO-1/2 masters as in bf16).
    "fp32": Precision("fp32", 4, 4, 0, 8, 4, 4, shard_master_bytes=4),
}


@dataclass(frozen=True)
class Workload:
    stats: ModelStats
    seq_len: int
    global_batch: int
    precision: Precision
    order: tuple[str, ...] = ("pp", "dp", "cp", "tp")  # outermost first
    keep_gathered: bool = False  # parallel.sp_keep_gathered (plan/activations.py)
    fp8: str = ""  # train.fp8: "" or the recipe; only then do the projections' matmuls get the FP8 speed-up

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch


def workload_from_config(cfg, precision: str | None = None) -> Workload:
    order = tuple(d.strip() for d in cfg.parallel.order.split(","))
    return Workload(stats=model_stats(cfg.model), seq_len=cfg.train.seq_len,
                    global_batch=cfg.train.global_batch,
                    precision=PRECISIONS[precision or cfg.train.dtype], order=order,
                    keep_gathered=cfg.parallel.sp_keep_gathered, fp8=cfg.train.fp8)
