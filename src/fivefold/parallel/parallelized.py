"""The façade of a parallelized model: the one object the trainer drives, whatever the layout.

Forward and backward of a step's micro-batches (or the pipeline's schedule), gradient sync and
clipping, the optimizer step, evaluation and whole-state gathering. Features that add to a step
(MoE router statistics, expert replicas, multi-token prediction) register a step hook
(parallel/step_hooks.py) instead of the façade reaching into them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from fivefold.mesh import ParallelDims
from fivefold.models.loss.weight import micro_batch_weight
from fivefold.parallel.collectives import all_reduce_scalars
from fivefold.parallel.comm_ledger import CommLedger
from fivefold.parallel.context.apply import SequenceSplit
from fivefold.parallel.data.base import DataParallel
from fivefold.parallel.expert.apply import gather_experts
from fivefold.parallel.loss import LMLoss, trained_positions
from fivefold.parallel.pipeline.stages import Pipeline
from fivefold.parallel.step_hooks import StepHook
from fivefold.plan.compile_choice import CompileChoice


class Parallelized:
    """This rank's part of a layout, as the trainer sees it: the same methods for every layout, so
    the trainer never asks which dimensions are active. parallelize() builds it."""

    def __init__(self, parts: list[nn.Module], dims: ParallelDims, mesh, data_parallel: DataParallel,
                 n_params: int, loss_parallel: bool, device: torch.device, pipeline: Pipeline | None = None,
                 mtp_depth: int = 0, tied_group=None, step_hooks: list[StepHook] = (), loss_fn: LMLoss | None = None,
                 compiling: CompileChoice = CompileChoice(False, "")):
        # parts: the model, or under pipeline parallelism the stages this rank runs.
        self.parts, self.dims, self.mesh, self.pipeline = parts, dims, mesh, pipeline
        self.device = device  # where the collectives of host numbers run (parallel/collectives.py)
        self.model = parts[0] if pipeline is None else None
        self.data_parallel = data_parallel
        self.n_params = n_params  # of the whole model, for FLOPs
        self._loss_parallel = loss_parallel
        self.dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
        self.dp_cp_group = mesh["dp_cp"].get_group() if mesh is not None else None
        self.ledger = CommLedger(group_dimensions(mesh)) if mesh is not None else None
        if tied_group is not None and self.ledger is not None:
            self.ledger.group_dims[tied_group.group_name] = "pp"  # the pipeline's two ends
        # All of each sequence unless cp > 1; labels with the tokens ahead under multi-token prediction.
        self._sequence_split = SequenceSplit.from_mesh(mesh, mtp_depth)
        self.tied_group = tied_group  # the two ranks holding a tied matrix split over pp, or None
        self.ep_mesh = mesh["ep"] if mesh is not None and dims.ep > 1 else None
        # What MoE layers, expert replicas and multi-token prediction add to a step (parallel/step_hooks.py).
        self.step_hooks = list(step_hooks)
        self.step_metrics: dict = {}  # the hooks' metrics of the last step (router load, aux and MTP loss)
        self.n_micro = 0  # micro-batches of the last forward_backward
        self.loss_fn = loss_fn or LMLoss()  # the pipeline's schedule holds the same object
        self.dp_group = mesh["dp"].get_group() if mesh is not None else None
        self.compiling = compiling  # whether the blocks were compiled, and for train.compile=auto why

    def _loss_context(self):
        if self._loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self._loss_context():
            return self.loss_fn(logits, labels)

    def forward_loss(self, inputs, labels, positions=None, documents=None) -> torch.Tensor:
        """The model's forward and LM loss on one micro-batch (no pipeline). Given the labels, the
        model returns its summed cross-entropy without making the logits (parallel/loss.py)."""
        with self._loss_context():
            return self.loss_fn(self.model(inputs, positions, documents, labels), labels)

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
        for hook in self.step_hooks:
            hook.before_step(self, n_micro)
        self.n_micro = n_micro
        # The losses a model adds beside the LM loss (MoE aux, MTP) weigh as each micro-batch's LM loss.
        with self.loss_fn.scaled_by(self._loss_scale(batch, n_micro)), micro_batch_weight(1.0 / n_micro):
            return self._forward_backward(batch, n_micro, autocast)

    def _forward_backward(self, batch: torch.Tensor, n_micro: int, autocast) -> torch.Tensor:
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
            self.data_parallel.sum_tied(self.pipeline, self.tied_group)
        self.data_parallel.finish_grads()

    def eval_loss(self, windows: torch.Tensor, autocast) -> float:
        """Mean loss of a batch without gradients (this rank's share; not yet averaged over dp)."""
        inputs, labels, positions, documents = self.split_windows(windows)
        scale = self._loss_scale(windows, self.pipeline.n_micro if self.pipeline is not None else 1)
        if self.pipeline is not None:
            if positions is None:
                positions = torch.arange(inputs.shape[1], device=inputs.device)[None]
            with torch.no_grad(), autocast(), self._loss_context(), self.loss_fn.scaled_by(scale):
                return self.pipeline.evaluate(inputs, labels, positions, documents).item()
        with torch.no_grad(), autocast(), self.loss_fn.scaled_by(scale):
            return self.loss_value(self.loss(self.model(inputs, positions, documents, labels), labels)).item()

    def _loss_scale(self, windows, n_micro: int) -> float | None:
        """Under a loss mask: the factor that makes each micro-batch's summed loss, once averaged
        over the n_micro micro-batches and the dp·cp ranks, the mean over the trained positions
        of the global batch (parallel/loss.py). Every rank of a dp group holds whole sequences
        of its share, so their counts summed over dp give the global batch's."""
        mine = trained_positions(windows)
        if mine is None:
            return None
        total = mine
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            total = int(all_reduce_scalars([float(mine)], self.dp_group, self.device).item())
        averaged_over = n_micro * (dist.get_world_size(self.dp_cp_group) if self.dp_cp_group is not None else 1)
        return averaged_over / total if total else 0.0  # nothing trained: no gradient

    def clip_grad_norm(self, max_norm: float) -> float:
        return self.data_parallel.clip_grad_norm(max_norm)

    def optimizer(self, make_optimizer) -> torch.optim.Optimizer:
        """`make_optimizer(tensors)` -> optimizer; this rank decides which tensors it updates."""
        return self.data_parallel.build_optimizer(make_optimizer)

    def settings_of(self, tensor: torch.Tensor):
        """The optimizer settings (config/param_groups.py) of a tensor `optimizer` handed out."""
        return self.data_parallel.settings_of(tensor)

    def muon_layout(self):
        return self.data_parallel.muon_layout()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.data_parallel.optimizer_step(optimizer)
        metrics = {}
        for hook in self.step_hooks:  # in order: router load and biases, expert replicas, MTP loss
            metrics.update(hook.after_optimizer_step(self, optimizer))
        self.step_metrics = metrics

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
        if self.dp_cp_group is None or dist.get_world_size(self.dp_cp_group) == 1:
            return value
        total = all_reduce_scalars([value], self.dp_cp_group, self.device)
        return total.item() / dist.get_world_size(self.dp_cp_group)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter as one whole CPU tensor under its single-device name (a collective:
        every rank must call it; all get the same result)."""
        from torch.distributed.tensor import DTensor

        out = {}
        masters = self.data_parallel.master_weights()  # bf16 runs: the fp32 masters, not the weights
        for part in self.parts:
            for name, param in part.named_parameters():
                if id(param) in masters:
                    param = as_layout_of(masters[id(param)], param)
                whole = param.full_tensor() if isinstance(param, DTensor) else param
                whole = gather_experts(name, whole, self.ep_mesh)  # each ep rank holds some experts
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


def as_layout_of(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's piece) laid out like `param`: a DTensor with its placements, or itself."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


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
