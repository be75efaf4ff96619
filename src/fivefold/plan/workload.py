"""What is being trained, independent of the layout: model statistics, sequence length, global
batch, the precision recipe (bytes per parameter for each piece of model state), and where mesh
dimensions sit (parallel.order)."""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.plan.cached_hash import cached_hash, state_without_hash
from fivefold.plan.lora import Lora
from fivefold.plan.model_stats import ModelStats, model_stats


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each piece of model state (Rajbhandari et al. 2019, ZeRO)."""
    __hash__ = cached_hash  # computed once: the search's memo tables are keyed by it
    __getstate__ = state_without_hash

    name: str
    param_bytes: int  # weights as the model computes with them (and as ZeRO-1/2 gather them)
    grad_bytes: int  # gradients as they are accumulated and reduced (sharded at ZeRO-2/3)
    accum_bytes: int  # a second, fp32 gradient accumulation buffer beside them (sharded at ZeRO-2)
    optim_bytes: int  # optimizer state: Adam moments, plus any fp32 master copy counted with them
    reduce_bytes: int  # bytes per element of the data-parallel gradient reduction
    act_bytes: int  # bytes per activation element
    shard_master_bytes: int = 0  # fp32 master of the owned chunk beside fp32 weights (fp32 ZeRO-1/2)
    master_bytes: int = 0  # fp32 master weights beside lower-precision weights (sharded from ZeRO-1)
    shard_param_bytes: int = 0  # weights as ZeRO-3 shards hold them, when not param_bytes
    # One fp32 moment: Muon (train.optimizer = muon) keeps one momentum per element of its
    # matrices where AdamW keeps two moments, so its elements hold this much less optimizer state.
    moment_bytes: int = 4


PRECISIONS = {
    # fivefold's trainer, the anchors' recipe (docs/precision.md): bf16 weights 2, an fp32 gradient
    # buffer 4 that accumulates the micro-batches and is reduced in fp32, fp32 master 4 + Adam
    # moments 8 with the optimizer: 2 + 4 + 12/dp at ZeRO-1 (Megatron's distributed optimizer),
    # 2 + 16/dp at ZeRO-2. ZeRO-3 (FSDP2's mixed precision) shards the fp32 masters (4) and
    # gathers them as bf16 (2): 16/dp.
    "bf16": Precision("bf16", 2, 4, 0, 8, 4, 2, master_bytes=4, shard_param_bytes=4),
    # Megatron / nanotron (the Playbook's runs): bf16 weights 2 + bf16 gradients 2 + fp32
    # gradient accumulation buffer 4 + fp32 master and Adam moments 12 = 20.
    "bf16_fp32_accum": Precision("bf16_fp32_accum", 2, 2, 4, 12, 4, 2),
    # Everything in fp32: weights 4, gradients 4, Adam moments 8; ZeRO-1/2 keep an fp32 master of
    # their chunk beside the weights (parallel/data/zero.py), ZeRO-1 its reduced chunk gradient too.
    "fp32": Precision("fp32", 4, 4, 0, 8, 4, 4, shard_master_bytes=4),
}


@dataclass(frozen=True)
class Workload:
    __hash__ = cached_hash  # computed once: the search's memo tables are keyed by it
    __getstate__ = state_without_hash

    stats: ModelStats
    seq_len: int
    global_batch: int
    precision: Precision
    order: tuple[str, ...] = ("pp", "dp", "cp", "tp")  # outermost first
    keep_gathered: bool = False  # parallel.sp_keep_gathered (plan/memory/activations.py)
    fp8: str = ""  # train.fp8: "" or the recipe; only then do the projections' matmuls get the FP8 speed-up
    muon: bool = False  # train.optimizer = muon: the block matrices keep one moment (plan/memory/peak.py)
    lora: Lora = Lora()  # [lora]: rank > 0 trains adapters only, the base frozen (plan/lora.py)
    # The busiest ep rank's routed rows over the mean (plan/speed/expert_load.py): measured
    # (`fivefold plan --moe-rank-imbalance`, the trainer's moe_rank_imbalance), 0 = routing noise only.
    moe_rank_imbalance: float = 0.0
    capacity_factor: float = 0.0  # model.moe.capacity_factor: caps the imbalance; 0 = dropless

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch


def workload_from_config(cfg, precision: str | None = None) -> Workload:
    order = tuple(d.strip() for d in cfg.parallel.order.split(","))
    return Workload(stats=model_stats(cfg.model), seq_len=cfg.train.seq_len,
                    global_batch=cfg.train.global_batch,
                    precision=PRECISIONS[precision or cfg.train.dtype], order=order,
                    keep_gathered=cfg.parallel.sp_keep_gathered, fp8=cfg.train.fp8,
                    muon=cfg.train.optimizer == "muon",
                    lora=Lora(cfg.lora.rank, cfg.lora.targets, cfg.lora.dropout),
                    capacity_factor=cfg.model.moe.capacity_factor)
