"""Activation recomputation of transformer blocks, applied after construction.

`full` keeps only each block's input and recomputes the whole block in backward. `selective`
keeps the outputs of matrix multiplies and attention (expensive to redo) and recomputes the cheap
elementwise work (norms, RoPE, SiLU), which holds most of the activation bytes. The block's
forward is wrapped in place, so parameter names (and checkpoint keys) do not change.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
if hasattr(torch.ops.aten, "_grouped_mm"):  # the experts' matmuls (models/moe.py)
    _SAVE.add(torch.ops.aten._grouped_mm.default)


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


# One wrapper per mode. torch.compile of a block (train.compile) traces through them, and dynamo
# (torch 2.13) accepts checkpoint()'s context_fn only when it is absent or a functools.partial built
# inside the traced code; a function passed in otherwise fails with "checkpoint not implemented for
# LazyVariableTracker context_fn".
def _recomputed_full(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _recomputed_selective(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def apply_recompute(blocks: nn.ModuleDict, mode: str) -> None:
    if mode == "none":
        return
    wrapper = _recomputed_selective if mode == "selective" else _recomputed_full
    for block in blocks.values():
        block.forward = functools.partial(wrapper, block.forward)
