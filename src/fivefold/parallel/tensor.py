"""Tensor parallelism (+ sequence parallelism): weights as DTensors, layers computing locally.

Which module gets which layout is the family's tensor-parallel plan (ModelSpec.block_plan and
root_plan, by module path and style, models/spec.py `TP`); this file implements the styles.
Megatron's layout: the column-split projections (heads, hidden units) take the whole stream and
the row-split ones' partial outputs are summed back into it, so each sub-layer needs one
all-reduce in forward and one in backward. With sequence parallelism the all-reduce becomes a
reduce-scatter (after the row-split projection) plus an all-gather (before the column-split ones),
and norms and residuals run on a 1/tp slice of the sequence. The layers (parallel/tp_layers.py)
compute on their local shards between those explicit collectives.

The embedding is split by vocabulary rows and the output layer by vocabulary columns: logits stay
sharded over tp (a DTensor) and the loss is computed by PyTorch's `loss_parallel` without ever
gathering them. Heads split evenly, so validate() requires tp to divide n_heads and n_kv_heads
(no kv replication), and the vocabulary splits evenly too.
"""

from __future__ import annotations

from torch import nn

from fivefold.models.spec import TP, ModelSpec
from fivefold.parallel.tp_layers import (ColumnParallelLinear, PartialGradLinear, PartialRMSNorm,
                                         RowParallelLinear, TensorParallelGroup, VocabParallelEmbedding,
                                         VocabParallelOutput)


def apply_tensor_parallel(model: nn.Module, spec: ModelSpec, cfg_model, tp_mesh, sequence_parallel: bool) -> None:
    group = TensorParallelGroup(tp_mesh, sequence_parallel)
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
    if style == TP.STREAM_NORM and not group.sequence_parallel:
        return  # a whole, replicated stream: the norm runs as it is
    replacements = {
        TP.COLUMN: lambda: ColumnParallelLinear(module, group),
        TP.ROW_TO_SEQUENCE: lambda: RowParallelLinear(module, group, group.scatter_sequence),
        TP.ROW_TO_TOKENS: lambda: RowParallelLinear(module, group, group.scatter_tokens),
        TP.STREAM_NORM: lambda: PartialRMSNorm(module, group),
        TP.PARTIAL_NORM: lambda: PartialRMSNorm(module, group),
        TP.REPLICATED_PARTIAL: lambda: PartialGradLinear(module, group),
        TP.VOCAB_EMBEDDING: lambda: VocabParallelEmbedding(module, group, group.scatter_sequence),
        TP.VOCAB_OUTPUT: lambda: VocabParallelOutput(module, group),
    }
    if style not in replacements:
        raise ValueError(f"tensor-parallel plan gives {path} the unknown style '{style}'; use one of {TP.ALL}")
    root.set_submodule(path, replacements[style]())


def _replicate_moe(moe: nn.Module, group: TensorParallelGroup) -> None:
    """An MoE layer under tensor parallelism takes the whole (replicated) residual stream, as the
    dense MLP does, and runs replicated on every tp rank (experts are not split by tp); its output
    goes back to the stream's layout (a local slice under sequence parallelism), as a plain tensor
    like the rest of the stream between blocks."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module

    stream = Shard(1) if group.sequence_parallel else Replicate()
    parallelize_module(moe, group.mesh, PrepareModuleInputOutput(
        input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(stream,), use_local_output=True))


def _gather_first_input(gather):
    def hook(module, args):
        return (gather(args[0]), *args[1:])
    return hook
