"""SwiGLU's gating, silu(gate) · up, keeping for backward only what its backward reads: gate and up.

Composed of `F.silu` and a product, autograd keeps gate (for silu's backward), silu(gate) and up
(for the product's): three tensors of the hidden width. silu(gate) is cheap to recompute from gate,
so this keeps two (Megatron's fused SwiGLU keeps the same). The forward is the same two operations;
backward recomputes silu(gate) and runs the kernels autograd runs for the composite:
    d up = dy · silu(gate),   d gate = silu'(gate) · (dy · up),
so the gradients are the composite's bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fivefold.torch_internals import aten_op

_silu_backward = aten_op("silu_backward").default


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        # autograd's own kernels on the composite's saved tensors, silu(gate) recomputed
        return _silu_backward(dy * up, gate), dy * F.silu(gate)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up (module docstring)."""
    return _SwiGLU.apply(gate, up)
