"""Tensor parallelism (+ sequence parallelism): weights as DTensors, layers computing locally.

Which module gets which layout is the family's tensor-parallel plan (ModelSpec.block_plan and
root_plan, by module path and style, models/spec.py `TP`); this file implements the styles.
Megatron's layout: the column-split projections (heads, hidden units) take the whole stream and
the row-split ones' partial outputs are summed back into it, so each sub-layer needs one
all-reduce in forward and one in backward. With sequence parallelism the all-reduce becomes a
reduce-scatter (after the row-split projection) plus an all-gather (before the column-split ones),
and norms and residuals run on a 1/tp slice of the sequence. The layers (parallel/tensor/layers.py)
compute on their local shards between those explicit collectives.

The embedding is split by vocabulary rows and the output layer by vocabulary columns: logits stay
sharded over tp (a DTensor) and the loss is computed by PyTorch's `loss_parallel` without ever
gathering them. Heads split evenly, so validate() requires tp to divide n_heads and n_kv_heads
(no kv replication), and the vocabulary splits evenly too.
"""

from __future__ import annotations


import torch
from torch import nn

from fivefold.models.moe.layer import Experts
from fivefold.models.spec import TP, ModelSpec
from fivefold.parallel.tensor.lora import carry_adapter, carry_expert_attributes
from fivefold.parallel.tensor.layers import (ColumnParallelLinear, HeadSplitValues, PartialGradLinear,
                                         PartialRMSNorm, RowParallelLinear, TensorParallelGroup,
                                         VocabParallelEmbedding, VocabParallelOutput, _SumValues)

# The attribute of an MoE layer holding its tp process group when its tokens are split over tp
# (read by parallel/expert/apply.py to sum router statistics).


def apply_tensor_parallel(model: nn.Module, spec: ModelSpec, cfg_model, tp_mesh, sequence_parallel: bool,
                          keep_shards: bool = False) -> None:
    """keep_shards: layers reading the gathered sequence save their shard of it (sharded_inputs.py)."""
    group = TensorParallelGroup(tp_mesh, sequence_parallel, keep_shards)
    # A pipeline stage has only some of the root modules (the others are None).
    present = {path: style for path, style in spec.root_plan.items() if _find(model, path) is not None}
    apply_plan(model, present, group)
    for index, block in model.layers.items():
        apply_plan(block, spec.block_plan(cfg_model, int(index)), group)


def _find(root: nn.Module, path: str):
    parent, _, name = path.rpartition(".")
    holder = root.get_submodule(parent) if parent else root
    return getattr(holder, name)


def apply_plan(root: nn.Module, plan: dict[str, str], group: TensorParallelGroup) -> None:
    """Lay out the modules of `root` named by `plan` (path -> TP style)."""
    # Modules sharing a weight (a tied embedding and output layer) must share it again afterwards;
    # both split the same (vocab, dim) matrix by vocabulary rows, so one DTensor serves both.
    shared: dict[int, list[str]] = {}
    for path in plan:
        weight = getattr(root.get_submodule(path), "weight", None)
        if weight is not None:
            shared.setdefault(id(weight), []).append(path)
    for path, style in plan.items():
        _apply_style(root, path, style, group)
    for paths in shared.values():
        for path in paths[1:]:
            root.get_submodule(path).weight = root.get_submodule(paths[0]).weight


def _apply_style(root: nn.Module, path: str, style: str, group: TensorParallelGroup) -> None:
    module = root.get_submodule(path)
    if style == TP.WHOLE_SEQUENCE_IN:
        module.register_forward_pre_hook(_gather_first_input(group.gather_sequence))
        return
    if style == TP.ALL_TOKENS_IN:
        module.register_forward_pre_hook(_gather_first_input(group.gather_tokens))
        return
    if style == TP.REPLICATED_MOE:
        _replicate_moe(module, group)
        return
    if style in (TP.STREAM_NORM, TP.STREAM_LINEAR) and not group.sequence_parallel:
        return  # a whole, replicated stream: the module runs as it is
    replacements = {
        TP.COLUMN: lambda: ColumnParallelLinear(module, group),
        TP.ROW_TO_SEQUENCE: lambda: RowParallelLinear(module, group, group.scatter_sequence),
        TP.ROW_TO_TOKENS: lambda: RowParallelLinear(module, group, group.scatter_tokens),
        TP.STREAM_NORM: lambda: PartialRMSNorm(module, group),
        TP.PARTIAL_NORM: lambda: PartialRMSNorm(module, group),
        TP.REPLICATED_PARTIAL: lambda: PartialGradLinear(module, group),
        TP.STREAM_LINEAR: lambda: PartialGradLinear(module, group),
        TP.HEAD_VALUES: lambda: HeadSplitValues(module, group),
        TP.VOCAB_EMBEDDING: lambda: VocabParallelEmbedding(module, group, group.scatter_sequence),
        TP.VOCAB_OUTPUT: lambda: VocabParallelOutput(module, group),
    }
    if style not in replacements:
        raise ValueError(f"tensor-parallel plan gives {path} the unknown style '{style}'; use one of {TP.ALL}")
    root.set_submodule(path, replacements[style]())
    carry_adapter(module, root.get_submodule(path), style, group)


def _replicate_moe(moe: nn.Module, group: TensorParallelGroup) -> None:
    """An MoE layer under tensor parallelism: weights replicated on every tp rank (experts are not
    split by tp; ep may spread them over tp ranks instead, parallel/expert/apply.py), tokens split. Each
    tp rank routes and computes only its 1/tp slice of the sequence, so no rank repeats another's
    expert work. Under sequence parallelism that slice is the stream's own local part: the layer
    runs on it as it comes, with no collective. Without it the stream is whole on every rank:
    each keeps its slice going in and the outputs are all-gathered coming out (one all-gather of
    the layer's output in forward and one of its input gradient in backward, instead of tp times
    the expert work).

    A weight that sees only this rank's tokens has a partial gradient: the router and shared
    experts (and the routed experts at ep = 1) are replicated DTensors with Partial gradients,
    summed over tp where gradients are settled, as for the sequence-parallel norms. Under ep > 1
    the routed experts are plain tensors again, and the expert-data-parallel group (mesh.py), which
    then spans the tp ranks holding the same experts, sums their partial gradients.
    Per-sequence decisions (capacity priority, the auxiliary loss) are taken on the whole
    sequence through the MoE's slice hooks (models/moe/layer.py); router statistics are summed over tp
    in expert.finish_router_step (parallelize.py gives its step hook the tp group)."""
    moe.router.gate = PartialGradLinear(moe.router.gate, group)
    if moe.shared is not None:  # every projection of the shared experts
        for name, layer in list(moe.shared.named_children()):
            if isinstance(layer, nn.Linear):
                setattr(moe.shared, name, PartialGradLinear(layer, group))
                carry_adapter(layer, getattr(moe.shared, name), TP.REPLICATED_PARTIAL, group)
    moe.experts = PartialGradExperts(moe.experts, group)
    moe.split_sequences(into_slices=SequenceSlices(group))
    if not group.sequence_parallel:
        moe.register_forward_pre_hook(lambda module, args: (_KeepSlice.apply(args[0], group), *args[1:]))
        moe.register_forward_hook(lambda module, args, out: _GatherSlices.apply(out, group))


class PartialGradExperts(Experts):
    """Stacked experts (models/moe/layer.py `Experts`, same parameter names) whose weights are replicated
    over tp and see this rank's tokens only: used with Partial gradients, like PartialGradLinear.
    Plain tensors (ep > 1 made them this rank's experts) are used as they are."""

    def __init__(self, experts: Experts, group: TensorParallelGroup):
        nn.Module.__init__(self)  # the stacked tensors come from `experts`, not new ones
        from torch.distributed.tensor import Replicate, distribute_tensor

        for name, whole in experts.named_parameters(recurse=False):
            setattr(self, name, nn.Parameter(distribute_tensor(whole.detach(), group.mesh, [Replicate()],
                                                               src_data_rank=None)))
        self.activation = experts.activation
        carry_expert_attributes(experts, self)

    def forward(self, x, counts: list[int]):
        return self.apply_weights(x, counts, _partial_local)


def _partial_local(weight):
    from torch.distributed.tensor import DTensor, Partial

    return weight.to_local(grad_placements=[Partial()]) if isinstance(weight, DTensor) else weight


class SequenceSlices:
    """A tp-split sequence as MoE decisions need it (models/moe/capacity.py SequenceSplit): this tp
    rank holds slice `rank` of `size` equal, consecutive slices of the rank's sequence."""

    def __init__(self, group: TensorParallelGroup):
        self.group = group
        self.chunks = [group.mesh.get_local_rank()]
        self.n_chunks = group.size

    @torch.compiler.disable  # a collective inside a layer's forward: keep it out of graphs
    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """(1, ...) of this slice -> (tp, ...) by slice. Counts: no autograd."""
        return self.group.all_gather(local)

    def total(self, t: torch.Tensor) -> torch.Tensor:
        """The statistic of the rank's whole sequence; backward: identity, since every tp rank holds
        the same auxiliary loss and the partial gradients it sends to each slice add up over tp."""
        return _SumValues.apply(t, self.group)


def _slice_of(x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
    local = x.shape[1] // group.size
    first = group.mesh.get_local_rank() * local
    return x[:, first:first + local]


def _gather_along_sequence(x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
    batch, local, dim = x.shape
    gathered = group.all_gather(x)  # (tp·batch, local, dim), rank-major
    return gathered.view(group.size, batch, local, dim).transpose(0, 1).reshape(batch, -1, dim)


class _KeepSlice(torch.autograd.Function):
    """A whole, replicated stream -> this rank's slice of the sequence; backward: the whole
    gradient (each rank computed its slice's), all-gathered, so it is whole on every rank again."""

    @staticmethod
    def forward(ctx, x, group: TensorParallelGroup):
        ctx.group = group
        return _slice_of(x, group).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_sequence(grad, ctx.group), None


class _GatherSlices(torch.autograd.Function):
    """Each rank's slice of the output -> the whole output on every rank; backward: the slice of
    the (replicated) gradient this rank's tokens produced."""

    @staticmethod
    def forward(ctx, x, group: TensorParallelGroup):
        ctx.group = group
        return _gather_along_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _slice_of(grad, ctx.group).contiguous(), None


def _gather_first_input(gather):
    def hook(module, args):
        return (gather(args[0]), *args[1:])
    return hook
