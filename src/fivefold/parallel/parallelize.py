"""The one place that turns a freshly built single-device model into this rank's part of a layout.

Order (DESIGN.md): tensor/sequence parallel -> expert -> context -> activation recomputation ->
compile -> data parallel (ZeRO / FSDP). The result, `Parallelized`, is all the trainer sees: it
never asks which dimensions are active.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fivefold.config import Config
from fivefold.mesh import ParallelDims
from fivefold.models.init import Fill
from fivefold.models.mtp import mtp_layers
from fivefold.models.registry import model_spec
from fivefold.parallel.collectives import all_reduce_scalars
from fivefold.parallel.comm_ledger import CommLedger
from fivefold.parallel.context import SequenceSplit, apply_context_parallel
from fivefold.parallel.data import DataParallel, build_data_parallel
from fivefold.parallel.expert import apply_expert_parallel, finish_router_step, gather_experts, set_aux_grad_scale
from fivefold.parallel.expert_replicas import after_optimizer_step
from fivefold.parallel.materialize import materialize
from fivefold.parallel.pipeline import Pipeline
from fivefold.parallel.recompute import apply_recompute
from fivefold.parallel.sharded_inputs import keeps_shards


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position (fp32 for a stable log-softmax). Labels
    (batch, seq, 1 + mtp_depth) carry multi-token prediction's targets too (models/mtp.py): the
    LM labels are their first column."""
    if labels.dim() == 3:
        labels = labels[..., 0]
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _future(labels: torch.Tensor) -> dict:
    """The model's keyword for multi-token prediction's targets, when the labels carry them."""
    return {"future": labels} if labels.dim() == 3 else {}


class Parallelized:
    def __init__(self, parts: list[nn.Module], dims: ParallelDims, mesh, data_parallel: DataParallel,
                 n_params: int, loss_parallel: bool, device: torch.device, pipeline: Pipeline | None = None,
                 mtp_depth: int = 0):
        # parts: the model, or under pipeline parallelism the stages this rank runs.
        self.parts, self.dims, self.mesh, self.pipeline = parts, dims, mesh, pipeline
        self.device = device  # where the collectives of host numbers run (parallel/collectives.py)
        self.model = parts[0] if pipeline is None else None
        self.data_parallel = data_parallel
        self.n_params = n_params  # of the whole model, for FLOPs
        self._loss_parallel = loss_parallel
        self.dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
        self._dp_cp_group = mesh["dp_cp"].get_group() if mesh is not None else None
        self.ledger = CommLedger(group_dimensions(mesh)) if mesh is not None else None
        # All of each sequence unless cp > 1; labels with the tokens ahead under multi-token prediction.
        self._sequence_split = SequenceSplit.from_mesh(mesh, mtp_depth)
        self._mtp_depth = mtp_depth
        self.mtp_metrics: dict = {}  # multi-token prediction's loss of the last step
        self._tied_group = None  # set by parallelize() when a tied matrix is split over pp ranks
        self._ep_mesh = mesh["ep"] if mesh is not None and dims.ep > 1 else None
        self.router_metrics: dict = {}  # MoE load, imbalance, drops, aux loss of the last step
        self._n_micro = 0  # of the last forward_backward (0: all recorded forwards)
        self._rebalance_every = 1  # parallel.ep_rebalance_every, set by parallelize()

    def _loss_context(self):
        if self._loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self._loss_context():
            return lm_loss(logits, labels)

    def forward_loss(self, inputs, labels, positions=None, documents=None) -> torch.Tensor:
        """The model's forward and LM loss on one micro-batch (no pipeline). The loss context is
        around the forward too: multi-token prediction computes its losses inside the model, on
        logits that tensor parallelism leaves vocabulary-sharded."""
        with self._loss_context():
            return lm_loss(self.model(inputs, positions, documents, **_future(labels)), labels)

    def backward(self, loss: torch.Tensor) -> None:
        with self._loss_context():
            loss.backward()

    @staticmethod
    def loss_value(loss: torch.Tensor) -> torch.Tensor:
        """The detached loss as a plain tensor (a vocab-parallel loss is a replicated DTensor)."""
        from torch.distributed.tensor import DTensor

        loss = loss.detach()
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def grad_sync(self, is_last: bool):
        return self.data_parallel.grad_sync(is_last)

    def split_sequence(self, windows: torch.Tensor):
        """(inputs, labels, RoPE positions or None) of this rank from windows of seq_len+1 tokens.
        Context parallelism keeps only this rank's part of each sequence here."""
        return self._sequence_split(windows)

    def split_windows(self, windows):
        """`split_sequence` of windows that may carry document ids (context.DocumentWindows):
        (inputs, labels, positions or None, document ids or None)."""
        return self._sequence_split.split(windows)

    def forward_backward(self, batch: torch.Tensor, n_micro: int, autocast) -> torch.Tensor:
        """Forward, loss and backward of every micro-batch of a step on this rank's share of the
        global batch; returns the sum of the micro-batch losses (each already divided by n_micro)."""
        # MoE aux loss weighs like each micro-batch's LM loss: 1/n_micro (the pipeline's too).
        set_aux_grad_scale(self.parts, 1.0 / n_micro)
        for part in self.parts:  # multi-token prediction's loss too
            for layer in mtp_layers(part):
                layer.aux_grad_scale = 1.0 / n_micro
        self._n_micro = n_micro
        if self.pipeline is not None:
            inputs, labels, positions, documents = self.split_windows(batch)
            if positions is None:
                positions = torch.arange(inputs.shape[1], device=inputs.device)[None]
            with autocast(), self._loss_context():
                return self.pipeline.run(inputs, labels, positions, documents)
        total = torch.zeros((), device=batch.device)
        for micro, chunk in enumerate(batch.chunk(n_micro)):
            inputs, labels, positions, documents = self.split_windows(chunk)
            with self.grad_sync(is_last=micro == n_micro - 1):
                with autocast():
                    loss = self.forward_loss(inputs, labels, positions, documents) / n_micro
                self.backward(loss)
            total += self.loss_value(loss)
        return total

    def finish_grads(self) -> None:
        if self.pipeline is not None:
            self.data_parallel.sum_tied(self.pipeline, self._tied_group)
        self.data_parallel.finish_grads()

    def eval_loss(self, windows: torch.Tensor, autocast) -> float:
        """Mean loss of a batch without gradients (this rank's share; not yet averaged over dp)."""
        inputs, labels, positions, documents = self.split_windows(windows)
        if self.pipeline is not None:
            if positions is None:
                positions = torch.arange(inputs.shape[1], device=inputs.device)[None]
            with torch.no_grad(), autocast(), self._loss_context():
                return self.pipeline.evaluate(inputs, labels, positions, documents).item()
        with torch.no_grad(), autocast():
            return self.loss_value(self.loss(self.model(inputs, positions, documents), labels)).item()

    def clip_grad_norm(self, max_norm: float) -> float:
        return self.data_parallel.clip_grad_norm(max_norm)

    def optimizer(self, make_optimizer) -> torch.optim.Optimizer:
        """`make_optimizer(tensors)` -> optimizer; this rank decides which tensors it updates."""
        return self.data_parallel.build_optimizer(make_optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.data_parallel.optimizer_step(optimizer)
        # MoE: the step's load over the global batch moves balancing biases; metrics for the log.
        self.router_metrics = finish_router_step(self.parts, self._dp_cp_group, self._n_micro, self.device)
        # Hot-expert replicas: re-plan from that load every few steps, copy the updated owners.
        after_optimizer_step(self.parts, self._rebalance_every, optimizer)
        if self._mtp_depth:
            self.mtp_metrics = self._take_mtp_loss()

    def _take_mtp_loss(self) -> dict:
        """`mtp_loss`: multi-token prediction's loss of the step (mean over its depths and the
        step's micro-batches, over the global batch), unweighted. Only the last pipeline stage
        computes it; every rank gets it."""
        mine = sum(sum(layer.take_losses(last=self._n_micro)) for part in self.parts for layer in mtp_layers(part))
        value = self.mean_over_dp(mine / (self._n_micro * self._mtp_depth))
        if self.pipeline is not None:
            value = all_reduce_scalars([value], self.pipeline.pp_group, self.device).item()
        return {"mtp_loss": value}

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        return self.data_parallel.state_bytes(optimizer)

    def bubble_fraction(self, step_time_s: float) -> float | None:
        """Measured pipeline bubble of the last step (None without a pipeline)."""
        return self.pipeline.take_bubble(step_time_s) if self.pipeline is not None else None

    def measure_comm(self):
        """Context around a step: the collectives inside it are entered in the ledger."""
        return self.ledger if self.ledger is not None else contextlib.nullcontext()

    def comm_bytes_last_step(self) -> dict[str, int]:
        return self.ledger.take() if self.ledger is not None else {}

    def mean_over_dp(self, value: float) -> float:
        """Average a per-rank scalar over the ranks that split the batch (dp and cp)."""
        if self._dp_cp_group is None or dist.get_world_size(self._dp_cp_group) == 1:
            return value
        total = all_reduce_scalars([value], self._dp_cp_group, self.device)
        return total.item() / dist.get_world_size(self._dp_cp_group)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter as one whole CPU tensor under its single-device name (a collective:
        every rank must call it; all get the same result)."""
        from torch.distributed.tensor import DTensor

        out = {}
        for part in self.parts:
            for name, param in part.named_parameters():
                whole = param.full_tensor() if isinstance(param, DTensor) else param
                whole = gather_experts(name, whole, self._ep_mesh)  # each ep rank holds some experts
                out[name] = whole.detach().cpu().clone()
        if self.pipeline is not None:
            stages = [None] * self.dims.pp
            dist.all_gather_object(stages, out, group=self.mesh["pp"].get_group())
            out = {name: tensor for stage in stages for name, tensor in stage.items()}
            for copy_name in self.pipeline.tied_pairs:
                out.pop(copy_name, None)  # the single-device model holds it once
        return out

    def describe(self) -> str:
        d = self.dims
        return (f"layout: dp={d.dp} (replicate {d.dp_replicate} x shard {d.dp_shard}) tp={d.tp} "
                f"pp={d.pp} cp={d.cp} ep={d.ep} | {self.n_params / 1e6:.2f}M parameters | "
                f"{self.data_parallel.name}")


def group_dimensions(mesh) -> dict[str, str]:
    """Process-group name -> the dimension its traffic belongs to, for the ledger."""
    dims = {}
    for view, label in (("dp_replicate", "dp"), ("dp_shard", "dp"), ("dp", "dp"), ("dp_cp", "dp"),
                        ("dp_shard_cp", "dp"), ("cp", "cp"), ("tp", "tp"), ("pp", "pp")):
        if mesh[view].size() > 1:
            dims[mesh[view].get_group().group_name] = label
    for view, label in (("ep", "ep"), ("edp", "dp")):  # present only under expert parallelism
        try:
            sub = mesh[view]
        except KeyError:
            continue
        if sub.size() > 1:
            dims[sub.get_group().group_name] = label
    return dims


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
    for part in parts:
        if dims.tp > 1:
            from fivefold.parallel.tensor import apply_tensor_parallel

            apply_tensor_parallel(part, spec, cfg.model, mesh["tp"], sequence_parallel=cfg.parallel.sp,
                                  keep_shards=keeps_shards(cfg))
        if dims.ep > 1:
            apply_expert_parallel(part, mesh["ep"], replicas=cfg.parallel.ep_replicas)
        if dims.cp > 1:
            apply_context_parallel(part, spec.attention_core, mesh["cp"], cfg.parallel.cp_method)
        apply_recompute(part.layers, cfg.train.recompute, lambda index: spec.block_plan(cfg.model, index),
                        stream_split=dims.tp if dims.tp > 1 and cfg.parallel.sp else 1,
                        compute_bytes=2 if cfg.train.dtype == "bf16" else 4)
        if cfg.train.compile:
            for block in part.layers.values():
                block.compile()
    ep_mesh = mesh["ep"] if dims.ep > 1 else None
    # FSDP2 shards meta parameters, then allocates only the shards; the other data-parallel
    # variants build their buckets and master chunks from real, initialised parameters.
    fsdp = cfg.parallel.zero == 3 and dims.dp * dims.cp > 1
    if not fsdp:
        materialize(parts, device, fill, ep_mesh)
    data_parallel = build_data_parallel(parts, dims, mesh, cfg, pipeline)
    if fsdp:
        materialize(parts, device, fill, ep_mesh)
    tied_group = None
    if pipeline is not None:
        tied_group = tied_embedding_group(dims, pipeline)
        for param in pipeline.tied_copies():
            data_parallel.extra_copies[id(param)] = 2  # the pipeline holds the matrix twice
        pipeline.build_schedule(cfg, lm_loss)
    par = Parallelized(parts, dims, mesh, data_parallel, n_params, loss_parallel=dims.tp > 1,
                       device=device, pipeline=pipeline, mtp_depth=cfg.model.mtp_depth)
    par._tied_group = tied_group
    par._rebalance_every = cfg.parallel.ep_rebalance_every
    if tied_group is not None and par.ledger is not None:
        par.ledger.group_dims[tied_group.group_name] = "pp"  # the pipeline's two ends
    return par


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
