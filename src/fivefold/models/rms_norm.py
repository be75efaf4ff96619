"""RMSNorm that keeps for backward only what its backward reads: the input in its own dtype and one
fp32 rstd per row.

The math is PyTorch's and Hugging Face's (`nn.RMSNorm`, `LlamaRMSNorm`): in fp32 inside,
    y = (x32 · rstd).to(x.dtype) · weight,   rstd = 1 / sqrt(mean(x32²) + eps),
forward op for op. Composed of those ops, autograd keeps the fp32 upcast of the input and the fp32
x32·rstd (8 bytes per element whatever the input's dtype: 4x a bf16 input). Here backward recomputes
x32·rstd from the saved input and rstd instead, and computes in fp32:
    dweight = Σ_rows dy · x̂,   g = dy · weight,   dx = rstd · (g − x̂ · mean(g · x̂)),
with x̂ = x32·rstd (x̂ rounded to x's dtype for dweight, as the forward multiplied it).
Per element of the input it keeps x's own bytes (2 under bf16), plus 4 bytes per row.
"""

from __future__ import annotations

import torch
from torch import nn


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        normed = (x32 * rstd).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return normed * weight if weight is not None else normed

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        dy32 = dy.float()
        dweight = None
        if weight is not None and ctx.needs_input_grad[1]:
            rows = tuple(range(dy.dim() - weight.dim()))
            dweight = (dy32 * normed.to(x.dtype).float()).sum(rows).to(weight.dtype)
        g = dy32 * weight.float() if weight is not None else dy32
        dx = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        return dx.to(x.dtype), dweight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (`weight` over it, or None); see the module docstring."""
    return _RMSNorm.apply(x, weight, eps)


class RMSNorm(nn.Module):
    """`RMSNorm(dim, eps)` with the same parameter and attributes, through `rms_norm`."""

    def __init__(self, dim: int, eps: float | None = None):
        super().__init__()
        self.normalized_shape = (dim,)
        self.eps = eps if eps is not None else torch.finfo(torch.float32).eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"
