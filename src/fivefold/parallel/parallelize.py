"""The one place that turns a freshly built single-device model into this rank's part of a layout.

Order (docs/design.md): pipeline split -> per part: tensor/sequence parallel -> expert -> FP8 ->
context -> activation recomputation -> compile; then materialise and data parallel (ZeRO / FSDP), the
pipeline's schedule, and the step hooks of the features in use. The result, `Parallelized`
(parallel/parallelized.py), is all the trainer sees: it never asks which dimensions are active.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fivefold.config import Config
from fivefold.mesh import ParallelDims
from fivefold.models.init import Fill
from fivefold.models.lora.adapters import freeze_all_but_adapters
from fivefold.models.moe.layer import moe_layers
from fivefold.models.registry import model_spec
from fivefold.models.spec import ModelSpec
from fivefold.parallel.context.apply import apply_context_parallel
from fivefold.parallel.data.build import build_data_parallel
from fivefold.parallel.expert.apply import RouterStep, apply_expert_parallel
from fivefold.parallel.expert.replicas import ReplicaStep, replica_slots
from fivefold.parallel.materialize import cast_parameters, materialize
from fivefold.parallel.loss import LMLoss
from fivefold.parallel.parallelized import Parallelized
from fivefold.parallel.pipeline.stages import Pipeline
from fivefold.parallel.recompute import apply_recompute
from fivefold.parallel.step_hooks import MultiTokenPredictionStep, StepHook
from fivefold.parallel.tensor.sharded_inputs import keeps_shards
from fivefold.plan.compile_choice import choose_compile


def parallelize(model: nn.Module, dims: ParallelDims, cfg: Config, device: torch.device,
                fill: Fill) -> Parallelized:
    """`model` is on the meta device: the layout is built there, then this rank's pieces are
    materialised on `device` with values from `fill` (parallel/materialize.py)."""
    spec = model_spec(cfg.model)
    n_params = sum(p.numel() for p in model.parameters())
    mesh = dims.build_mesh(device.type) if dims.world_size > 1 else None
    if mesh is not None:
        dims.warn_if_tp_crosses_nodes(cfg.parallel.gpus_per_node)
    pipeline = Pipeline(model, cfg, spec, mesh["pp"], device) if dims.pp > 1 else None
    parts = pipeline.parts if pipeline is not None else [model]
    compiling = choose_compile(cfg, device.type, torch.get_num_threads())  # train.compile = auto too
    for part in parts:
        apply_dimensions(part, spec, cfg, dims, mesh, compiling.compile)
    data_parallel = shard_and_materialize(parts, dims, mesh, cfg, pipeline, device, fill)
    tied_group = None
    loss_fn = LMLoss()
    if pipeline is not None:
        tied_group = tied_embedding_group(dims, pipeline)
        for param in pipeline.tied_copies():
            data_parallel.extra_copies[id(param)] = 2  # the pipeline holds the matrix twice
        pipeline.build_schedule(cfg, loss_fn)
    return Parallelized(parts, dims, mesh, data_parallel, n_params, loss_parallel=dims.tp > 1, device=device,
                        pipeline=pipeline, mtp_depth=cfg.model.mtp_depth, tied_group=tied_group,
                        step_hooks=step_hooks(parts, cfg, mesh["tp"] if dims.tp > 1 else None), loss_fn=loss_fn, compiling=compiling)


def apply_dimensions(part: nn.Module, spec: ModelSpec, cfg: Config, dims: ParallelDims, mesh,
                     compile_blocks: bool) -> None:
    """The fixed order on one part (the model or a pipeline stage), still on the meta device."""
    if dims.tp > 1:
        from fivefold.parallel.tensor.apply import apply_tensor_parallel

        apply_tensor_parallel(part, spec, cfg.model, mesh["tp"], sequence_parallel=cfg.parallel.sp,
                              keep_shards=keeps_shards(cfg, compile_blocks))
    if dims.ep > 1:
        apply_expert_parallel(part, mesh["ep"], replicas=cfg.parallel.ep_replicas)
    if cfg.train.fp8:  # the dense projections, tensor-parallel or not (parallel/float8.py)
        from fivefold.parallel.float8 import apply_float8, float8_all_gather

        apply_float8(part, spec, cfg.model, cfg.train.fp8, fsdp_all_gather=float8_all_gather(cfg, dims),
                     token_mesh=mesh["cp"] if dims.cp > 1 else None)
    if dims.cp > 1:
        apply_context_parallel(part, spec.attention_core, mesh["cp"], cfg.parallel.cp_method)
    if cfg.lora.rank:  # after the steps above, which make new parameters (trainable by default)
        freeze_all_but_adapters(part)
    apply_recompute(part.layers, cfg.train.recompute, lambda index: spec.block_plan(cfg.model, index),
                    stream_split=dims.tp if dims.tp > 1 and cfg.parallel.sp else 1,
                    compute_bytes=2 if cfg.train.dtype == "bf16" else 4, low_rank=cfg.lora.rank)
    if compile_blocks:  # one graph per block kind: identical blocks share it (plan/compile_choice.py)
        for block in part.layers.values():
            block.compile()


def shard_and_materialize(parts: list[nn.Module], dims: ParallelDims, mesh, cfg: Config, pipeline,
                          device: torch.device, fill: Fill):
    """This rank's pieces in real memory, and the data-parallel variant of parallel.zero."""
    ep_mesh = mesh["ep"] if dims.ep > 1 else None
    # FSDP2 shards meta parameters, then allocates only the shards; the other data-parallel
    # variants build their buckets and master chunks from real, initialised parameters.
    fsdp = cfg.parallel.zero == 3 and dims.dp * dims.cp > 1
    # bf16: the parameters are bf16 and the fp32 masters live with the optimizer (parallel/data/);
    # under FSDP2 the parameters are the fp32 master shards and its policy casts them for compute.
    rounding = torch.bfloat16 if cfg.train.dtype == "bf16" else None
    if rounding is not None and not fsdp:
        for part in parts:
            cast_parameters(part, rounding)
    if not fsdp:
        materialize(parts, device, fill, ep_mesh, rounding)
    data_parallel = build_data_parallel(parts, dims, mesh, cfg, pipeline)
    if fsdp:
        materialize(parts, device, fill, ep_mesh, rounding)
    return data_parallel


def step_hooks(parts: list[nn.Module], cfg: Config, tp_mesh=None) -> list[StepHook]:
    """What the features of this model add to each step, in the order they run after it."""
    hooks: list[StepHook] = []
    if any(True for part in parts for _ in moe_layers(part)):
        hooks.append(RouterStep(tp_mesh.get_group() if tp_mesh is not None else None))
    if replica_slots(parts):
        hooks.append(ReplicaStep(cfg.parallel.ep_rebalance_every))
    if cfg.model.mtp_depth:
        hooks.append(MultiTokenPredictionStep(cfg.model.mtp_depth))
    if cfg.train.qk_clip:
        from fivefold.parallel.qk_clip import QKClipStep

        hooks.append(QKClipStep(parts, cfg.train.qk_clip))
    return hooks


def tied_embedding_group(dims: ParallelDims, pipeline: Pipeline):
    """The group of the two ranks holding copies of the tied embedding matrix (first and last
    stage, same dp/cp/tp coordinates), or None when no copy is split across ranks. Every rank
    creates every such group (process-group creation is collective)."""
    first, last = pipeline.tied_group_members()
    if not pipeline.tied or first == last:
        return None
    mine = None
    for pp_ranks in dims.groups("pp"):
        pair = [pp_ranks[first], pp_ranks[last]]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine
