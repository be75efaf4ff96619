"""SwiGLU's gating, silu(gate) · up, keeping for backward only what its backward reads: gate and up.

Composed of `F.silu` and a product, autograd keeps gate (for silu's backward), silu(gate) and up
(for the product's): three tensors of the hidden width. silu(gate) is cheap to recompute from gate,
so this keeps two (Megatron's fused SwiGLU keeps the same). The forward is the same two operations;
backward recomputes sigmoid(gate) and forms, in fp32,
    d up = dy · silu(gate),   d gate = dy · up · sigmoid(gate) · (1 + gate · (1 − sigmoid(gate))).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        gate32, dy32 = gate.float(), dy.float()
        sigmoid = torch.sigmoid(gate32)
        d_up = dy32 * (gate32 * sigmoid)
        d_gate = dy32 * up.float() * sigmoid * (1 + gate32 * (1 - sigmoid))
        return d_gate.to(gate.dtype), d_up.to(up.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up (module docstring)."""
    return _SwiGLU.apply(gate, up)
