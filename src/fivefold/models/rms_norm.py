"""RMSNorm that keeps for backward only what its backward reads: the input in its own dtype and one
fp32 rstd per row.

The math is PyTorch's and Hugging Face's (`nn.RMSNorm`, `LlamaRMSNorm`): in fp32 inside,
    y = (x32 · rstd).to(x.dtype) · weight,   rstd = 1 / sqrt(mean(x32²) + eps),
forward op for op. Composed of those ops, autograd keeps the fp32 upcast of the input and the fp32
x32·rstd (8 bytes per element whatever the input's dtype: 4x a bf16 input). Here backward recomputes
x̂ = x32·rstd from the saved input and rstd instead, and takes the closed form of the gradient:
    dweight = Σ_rows dy · x̂ (x̂ rounded to x's dtype, as the forward multiplied it),
    g = dy · weight,   dx = rstd · (g − x̂ · mean(g · x̂)),
in fp32: five passes over the rows where the composite's backward takes a dozen (half its time on
one CPU thread). It equals the composite's gradient up to the rounding of the input's dtype.
Per element of the input it keeps x's own bytes (2 under bf16), plus 4 bytes per row. fp32 inputs
keep the composite (`rms_norm`): their input and x·rstd, 8 bytes per element.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
        normed = x.to(torch.float32, copy=True).mul_(rstd)  # x̂, fp32, a buffer of its own
        dweight = None
        if weight is not None:
            if ctx.needs_input_grad[1]:
                dweight = (dy * normed.to(x.dtype)).sum(tuple(range(dy.dim() - weight.dim())))
            dy = dy * weight
        g = dy.to(torch.float32, copy=True)  # changed in place below; dy is autograd's
        projection = (g * normed).mean(-1, keepdim=True)
        dx = g.sub_(normed.mul_(projection)).mul_(rstd)
        return dx.to(x.dtype), dweight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (`weight` over it, or None); see the module docstring.
    An fp32 input takes PyTorch's composite: there the fp32 copy is the input itself, so the
    saving is x·rstd alone, and the composite's two gradient paths into the input join the
    residual stream's one by one, an order a single backward cannot reproduce, which tensor-parallel
    layouts compared with one process at 1e-5 can see."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
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
