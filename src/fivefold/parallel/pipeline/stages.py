"""Pipeline parallelism through `torch.distributed.pipelining`: stages and schedules.

The model is cut into pp × pp_virtual stages (plan/pipeline/stage_split.py); this rank builds the
stages it runs, each a copy of the full model with the other layers removed, so parameter names
(and checkpoint keys) stay those of the single-device model. The first stage owns the embedding,
the last the final norm, output layer and loss (the family's ModelSpec.first_stage / last_stage);
given the micro-batch's targets, the output layer returns the summed cross-entropy, so no logits
are made. A step's micro-batches are the schedule's micro-batches, each micro-batch loss divided by their number: exactly the gradient accumulation
of the non-pipelined run.

Tied embeddings: the first and the last stage each hold a copy of the matrix; the copies'
gradients are summed (over the pair of ranks when the stages live apart) before the update, so
the copies stay equal.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                          ScheduleZBVZeroBubble)
from torch.distributed.tensor import DTensor

from fivefold.config import Config, micro_batches
from fivefold.models.spec import ModelSpec
from fivefold.parallel.collectives import all_reduce_scalars
from fivefold.parallel.grad_norm import local_tensor, settle_grad_layout
from fivefold.config.schedules import SINGLE_STAGE_SCHEDULES
from fivefold.plan.pipeline.stage_split import layers_per_stage, stages_of_rank
from fivefold.parallel.pipeline.observed_stage import ObservedStage
from fivefold.torch_internals import dtensor_local_tensor, is_view, recv_info_buffer, stage_args_recv_info, stage_fwd_cache

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


class StagePositions:
    """The RoPE positions (and, under document masking, document ids; on the last stage the targets,
    with multi-token prediction the tokens ahead of each position) every stage of this rank uses for
    the current step: a stage receives only hidden states, which under sequence parallelism hold a
    slice of the sequence.
    Positions shared by every sequence are one (1, seq) tensor; per-sequence ones are cut into the
    schedule's micro-batches, and each stage reads those of the micro-batch it is running
    (`select`, called as each forward starts)."""

    value: torch.Tensor | None = None  # the positions of the micro-batch being run
    documents: torch.Tensor | None = None  # its document ids, or None
    targets: torch.Tensor | None = None  # its labels (models/decoder.py Transformer.forward)

    def set(self, positions: torch.Tensor, documents: torch.Tensor | None, n_micro: int,
            targets: torch.Tensor) -> None:
        self._positions = positions.chunk(n_micro) if positions.shape[0] > 1 else [positions] * n_micro
        self._documents = documents.chunk(n_micro) if documents is not None else [None] * n_micro
        self._targets = targets.chunk(n_micro)
        self.select(0)

    def select(self, micro: int) -> None:
        self.value, self.documents = self._positions[micro], self._documents[micro]
        self.targets = self._targets[micro]


def build_stage_module(full: nn.Module, spec: ModelSpec, layer_ids: list[int], first: bool, last: bool,
                       positions: StagePositions) -> nn.Module:
    part = copy.deepcopy(full)
    for name in list(part.layers.keys()):
        if int(name) not in layer_ids:
            del part.layers[name]
    dropped = ([] if first else list(spec.first_stage)) + ([] if last else list(spec.last_stage))
    for path in dropped:  # the model's forward skips a module that is None
        parent, _, name = path.rpartition(".")
        setattr(part.get_submodule(parent), name, None)
    forward = part.forward
    part.forward = lambda x: forward(x, positions.value, positions.documents, positions.targets)
    return part


def _release_sent_outputs(stage, free_after_backward: bool) -> None:
    """Once a stage has built the send of a micro-batch's output, that output's data is not needed
    on this rank any more: the backward needs only the output's autograd node and shape (the
    gradient comes from the next stage). The schedule keeps the output until that backward
    (torch's fwd_cache), one whole activation per micro-batch in flight; pointing it at a
    one-element placeholder of the same shape (stride 0) drops that reference at the send, as
    Megatron-LM does. The send itself holds the storage until it completes and its work is let go:
    Schedule1F1B lets go one micro-batch later, but GPipe and the multi-stage runtime keep every
    send's work until the step ends. For those (`free_after_backward`) the storage is emptied once
    the micro-batch's backward has run on this stage: its gradient came back, so the next stage
    had received the output, and the send was done."""
    sent: dict[int, list] = {}

    def release(chunk: int, ops) -> None:
        outputs, _ = stage_fwd_cache(stage)[chunk]
        if free_after_backward and torch.is_grad_enabled():  # evaluation runs no backward
            sent[chunk] = [op.tensor.untyped_storage() for op in ops]
        for output in outputs:
            _release_data(output)
    stage.sends_built.append(release)
    if free_after_backward:
        stage.backward_done.append(lambda chunk: [storage.resize_(0) for storage in sent.pop(chunk, ())])


def _release_local_inputs(stage) -> None:
    """A V schedule hands the output of a rank's stage straight to its next stage, on the same
    rank, as that stage's input (no send), and keeps it in two places longer than the next stage's
    backward needs it: the previous stage's fwd_cache (until that stage's backward) and the next
    stage's receive slot of the micro-batch (until the next step). The first is released as at a
    send; the second once the next stage's backward of the micro-batch is over."""
    local: set[int] = set()

    def taken(chunk: int, prev_stage_outputs) -> None:
        outputs = prev_stage_outputs if isinstance(prev_stage_outputs, tuple) else (prev_stage_outputs,)
        for output in outputs:
            if isinstance(output, torch.Tensor):
                _release_data(output)
        if torch.is_grad_enabled():
            local.add(chunk)

    def release(chunk: int) -> None:
        if chunk in local:
            local.discard(chunk)
            for info in stage_args_recv_info(stage)[chunk]:
                if recv_info_buffer(info) is not None:
                    _release_data(recv_info_buffer(info))
    stage.local_input.append(taken)
    stage.backward_done.append(release)


def _release_data(tensor) -> None:
    local = dtensor_local_tensor(tensor) if isinstance(tensor, DTensor) else tensor
    # A view shares its base's storage, which something else may hold: leave it.
    if isinstance(local, torch.Tensor) and not is_view(local) and local.numel() > 1:
        local.data = torch.empty((), dtype=local.dtype, device=local.device).expand(local.shape)


class Pipeline:
    """This rank's stages and the schedule that runs them."""

    def __init__(self, model: nn.Module, cfg: Config, spec: ModelSpec, pp_mesh, device: torch.device):
        p = cfg.parallel
        self.pp_group, self.pp_rank, self.pp = pp_mesh.get_group(), pp_mesh.get_local_rank(), p.pp
        self.n_stages = p.pp * p.pp_virtual
        self.schedule_name = p.pp_schedule
        self.positions = StagePositions()
        layers = layers_per_stage(cfg.model, self.n_stages, p.pp_layers, cfg.train.seq_len)
        # Blocks past the model's layers (multi-token prediction) read the output layer's input
        # and share its matrix: they go with the last stage.
        layers[-1] = layers[-1] + [int(i) for i in model.layers if int(i) >= cfg.model.n_layers]
        self.stage_ids = stages_of_rank(self.pp_rank, p.pp, p.pp_virtual, p.pp_schedule)
        self.parts = [build_stage_module(model, spec, layers[s], s == 0, s == self.n_stages - 1, self.positions)
                      for s in self.stage_ids]
        # Tied pairs (copy -> source): the source lives on the first stage, the copy on the last.
        self.tied_pairs = spec.tied(cfg.model)
        self.tied = bool(self.tied_pairs)
        self.device = device
        self.has_first, self.has_last = 0 in self.stage_ids, self.n_stages - 1 in self.stage_ids
        self.n_micro = 0
        # ZeRO-2 sets this: called with a part's index each time a backward action has completed
        # that part's weight gradients of one micro-batch (parallel/data/zero.py reduce-scatters them).
        self.on_weight_grads = None

    def tied_copies(self) -> list[nn.Parameter]:
        """This rank's copies of the tied embedding matrix: the first stage's embedding and the
        last stage's output weight, separate parameters even when both stages run here (a shared
        one would have its gradient scaled once per stage by the schedule)."""
        # Every pair's source is the embedding matrix, so all copies are one matrix's; a stage
        # holding two of them (a tied output layer and multi-token prediction's embedding) holds
        # one Parameter, counted once.
        copies: dict[int, nn.Parameter] = {}
        for copy_name, source in self.tied_pairs.items():
            if self.has_first:
                param = self.parts[self.stage_ids.index(0)].get_parameter(source)
                copies[id(param)] = param
            if self.has_last:
                param = self.parts[self.stage_ids.index(self.n_stages - 1)].get_parameter(copy_name)
                copies[id(param)] = param
        return list(copies.values())

    def tied_group_members(self) -> tuple[int, int]:
        """pp ranks of the first and the last stage (different ranks when tied_copy() is not None)."""
        from fivefold.plan.pipeline.stage_split import stage_to_rank

        return (stage_to_rank(0, self.pp, self.schedule_name),
                stage_to_rank(self.n_stages - 1, self.pp, self.schedule_name))

    def build_schedule(self, cfg: Config, loss_fn) -> None:
        self.n_micro = micro_batches(cfg)
        stages = [ObservedStage(part, s, self.n_stages, self.device, group=self.pp_group)
                  for part, s in zip(self.parts, self.stage_ids)]
        self.stages = stages
        for index, stage in enumerate(stages):
            self._select_inputs(stage)
            if not stage.is_first:
                _release_local_inputs(stage)
            if not stage.is_last:
                _release_sent_outputs(stage, free_after_backward=self.schedule_name != "1f1b")
            if self.on_weight_grads is not None:
                self._report_weight_grads(stage, index)
        cls = SCHEDULES[self.schedule_name]
        target = stages[0] if self.schedule_name in SINGLE_STAGE_SCHEDULES else stages
        # Each micro-batch's loss is divided by their number before its backward, exactly as in
        # the non-pipelined gradient accumulation, instead of scaling the summed gradients after
        # (scale_grads): the same floating-point operations, so the same weights to the last bit
        # wherever the accumulation order is the same.
        n_micro = self.n_micro
        self.schedule = cls(target, n_microbatches=n_micro, loss_fn=lambda out, y: loss_fn(out, y) / n_micro,
                            scale_grads=False)

    def _select_inputs(self, stage) -> None:
        """Before each forward of a micro-batch, point the stages at its positions and document ids
        (a recomputed forward in backward reuses the tensors the block was first called with)."""
        stage.before_forward.append(self.positions.select)

    def _report_weight_grads(self, stage, index: int) -> None:
        """Call on_weight_grads(index) after every action that leaves a micro-batch's weight
        gradients complete: a full backward, or a split backward's later weight pass (the input
        pass alone computes no weight gradient)."""
        stage.backward_done.append(lambda chunk: self.on_weight_grads(index))

    def run(self, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
            documents: torch.Tensor | None = None) -> torch.Tensor:
        """One step of the schedule; returns the step loss (sum of the scaled micro-batch losses) on
        every pp rank. `labels` (batch, seq, 1 + mtp_depth) under multi-token prediction."""
        self.positions.set(positions, documents, self.n_micro, labels)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": labels, "losses": losses} if self.has_last else {}
        # return_outputs=False: the last stage's outputs (each micro-batch's summed loss) are not
        # gathered for the caller; the losses list is all we read.
        self.schedule.step(*args, return_outputs=False, **kwargs)
        return self._reduce_loss(losses, inputs.device)

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
                 documents: torch.Tensor | None = None) -> torch.Tensor:
        """Forward only through the pipeline; the loss (sum of the scaled micro-batch losses) on every pp rank."""
        self.positions.set(positions, documents, self.n_micro, labels)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": labels, "losses": losses} if self.has_last else {}
        self.schedule.eval(*args, return_outputs=False, **kwargs)
        return self._reduce_loss(losses, inputs.device)

    def take_bubble(self, step_time_s: float) -> float:
        """Measured idle share of the pipeline ranks in the last step: 1 - busy / step time,
        averaged over the pp ranks (busy = time inside the stages' forward/backward actions)."""
        busy = all_reduce_scalars([sum(stage.busy_s for stage in self.stages)], self.pp_group, self.device)
        for stage in self.stages:
            stage.busy_s = 0.0
        return max(0.0, 1.0 - busy.item() / (self.pp * step_time_s))

    def _reduce_loss(self, losses: list[torch.Tensor], device) -> torch.Tensor:
        loss = torch.stack([local_tensor(l.detach()) for l in losses]).sum() if self.has_last \
            else torch.zeros((), device=device)
        # Only the last stage knows the loss; every rank reports it.
        dist.all_reduce(loss, group=self.pp_group)
        return loss

    def sum_tied_grads(self, group) -> None:
        """Give every copy of the tied matrix the sum of all copies' gradients (same shard layout
        on every copy), so the copies receive identical updates and stay equal."""
        copies = [p for p in self.tied_copies() if p.grad is not None]
        if not copies:
            return
        for param in copies:
            settle_grad_layout(param)  # e.g. a vocab-parallel gradient left whole by the schedule
        total = local_tensor(copies[0].grad).clone()
        for param in copies[1:]:
            total += local_tensor(param.grad)
        if group is not None:
            dist.all_reduce(total, group=group)
        for param in copies:
            local_tensor(param.grad).copy_(total)
