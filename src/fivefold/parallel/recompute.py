"""Activation recomputation of transformer blocks, applied after construction.

`full` keeps only each block's input and recomputes the whole block in backward. `selective`
keeps the outputs of matrix multiplies and attention (expensive to redo) and recomputes the cheap
elementwise work (norms, RoPE, SiLU), which holds most of the activation bytes; under LoRA it also
recomputes each adapter's up-projection B (A x) from the kept A x (rank/in of its layer's matmul). It checkpoints each
residual branch of a block on its own (the block names them in `residual_branches`), keeping the
stream between them, and keeps the inputs of each branch's output projection (the tensor-parallel
plan's row-split modules) rather than its output: that output, whole-sequence partial sums under
tensor parallelism, is what Megatron's layout never keeps (parallel/stream_projection.py). Forwards
are wrapped in place, so parameter names (and checkpoint keys) do not change.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fivefold.models.spec import TP
from fivefold.plan.memory.branch_split import split_branches
from fivefold.parallel.stream_projection import keep_projection_inputs, project
from fivefold.torch_internals import aten_op, has_aten_op

_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    aten_op("_scaled_dot_product_flash_attention").default,
    aten_op("_scaled_dot_product_efficient_attention").default,
    aten_op("_scaled_dot_product_flash_attention_for_cpu").default,
}
if has_aten_op("_grouped_mm"):  # the experts' matmuls (models/moe/layer.py)
    _SAVE.add(aten_op("_grouped_mm").default)
# A block checkpointed whole saves its output projections' outputs too (recomputing them would
# cost a matmul); a branch checkpointed on its own keeps their inputs instead (apply_recompute).
_SAVE_WHOLE = _SAVE | {torch.ops.fivefold.stream_projection.default}


# Matmuls whose first operand's last dimension is the one they contract over.
_LINEAR = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
if has_aten_op("_grouped_mm"):
    _LINEAR.add(aten_op("_grouped_mm").default)


def _low_rank_up(op, args, low_rank: int) -> bool:
    """A LoRA adapter's up-projection B (A x): a matmul contracting over at most the adapters' rank.
    Redone in backward from the kept A x, it costs rank/in of its layer's matmul, where keeping it
    would keep a tensor as wide as the layer's output."""
    if not low_rank or op not in _LINEAR:
        return False
    first = args[1] if op is torch.ops.aten.addmm.default else args[0]
    return first.shape[-1] <= low_rank


def _policy(whole: bool, low_rank: int, ctx, op, *args, **kwargs):
    """Selective recomputation: keep the matmuls' and attention's outputs (a block checkpointed
    whole, `whole`, its output projections' too), redo the rest and, under LoRA (`low_rank`:
    lora.rank, 0 without), the adapters' up-projections."""
    if op not in (_SAVE_WHOLE if whole else _SAVE) or _low_rank_up(op, args, low_rank):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


# One wrapper per mode (selective: whole blocks or residual branches). torch.compile of a block
# (train.compile) traces through them, and dynamo (torch 2.13) accepts checkpoint()'s context_fn
# only when it is absent or a functools.partial built inside the traced code; a function passed in
# otherwise fails with "checkpoint not implemented for LazyVariableTracker context_fn".
def _recomputed_full(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _recomputed_selective(whole: bool, low_rank: int, forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    context_fn = functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, whole, low_rank))
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def apply_recompute(blocks: nn.ModuleDict, mode: str, block_plan=lambda index: {}, stream_split: int = 1,
                    compute_bytes: int = 4, low_rank: int = 0) -> None:
    """Wrap each block for `mode`. `block_plan(index)` is the tensor-parallel plan of block `index`
    (module path -> style), which names the output projections; stream_split and compute_bytes
    (the ranks sharing the stream's tokens, the autocast dtype's size) decide whether the branches
    are checkpointed apart (plan/memory/branch_split.py). `low_rank` (lora.rank, 0 without LoRA): under
    selective recomputation the adapters' up-projections are redone, not kept."""
    if mode == "none":
        return
    for index, block in blocks.items():
        if mode == "full":
            block.forward = functools.partial(_recomputed_full, block.forward)
            continue
        projections = [block.get_submodule(path) for path, style in block_plan(int(index)).items()
                       if style in (TP.ROW_TO_SEQUENCE, TP.ROW_TO_TOKENS)]
        branches = getattr(block, "residual_branches", ())
        weights = [_local_shape(p.weight) for p in projections]
        if branches and split_branches(weights[0][0] if weights else 0, stream_split, _stream_bytes(block),
                                       compute_bytes, [w[1] for w in weights]):
            for projection in projections:
                _keep_projection_inputs(projection)
            for name in branches:
                setattr(block, name, functools.partial(_recomputed_selective, False, low_rank, getattr(block, name)))
        else:  # one region: the projections' outputs are kept (the policy saves every matmul's)
            block.forward = functools.partial(_recomputed_selective, True, low_rank, block.forward)


def _local_shape(weight) -> tuple[int, int]:
    return tuple((weight.to_local() if hasattr(weight, "to_local") else weight).shape)


def _stream_bytes(block: nn.Module) -> int:
    # The stream between blocks is in the parameters' dtype (autocast computes, it does not store).
    return next(block.parameters()).element_size()


def _keep_projection_inputs(module: nn.Module) -> None:
    if type(module) is nn.Linear:  # no tensor parallelism: as the row-split layer computes it
        # A bias is added after the projection, in its dtype (its gradient needs nothing saved).
        module.forward = lambda x, module=module: _plus_bias(project(x, module.weight), module.bias)
    module.forward = keep_projection_inputs(module.forward)


def _plus_bias(out: torch.Tensor, bias) -> torch.Tensor:
    return out if bias is None else out + bias.to(out.dtype)
