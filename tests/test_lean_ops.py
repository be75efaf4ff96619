"""The ops that keep less for backward (models/rms_norm.py, models/swiglu.py) give the gradients of
the compositions they replace: SwiGLU's bit for bit, the bf16 norm's within bf16 rounding of the
exact gradient (it takes the closed form, not the composite's dozen passes)."""

import pytest
import torch
import torch.nn.functional as F

from fivefold.models.rms_norm import rms_norm
from fivefold.models.swiglu import swiglu

BF16_UNIT_ROUNDOFF = 2.0 ** -8


def _grads(fn, *inputs, upstream):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(upstream)
    return out.detach(), [leaf.grad for leaf in leaves]


def _relative(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.double() - exact).norm() / exact.norm()).item()


def test_bf16_norm_equals_the_exact_gradient_within_bf16_rounding():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 64, 96, generator=g) * 3).bfloat16()
    weight = (torch.rand(96, generator=g) + 0.5).bfloat16()
    upstream = torch.randn(4, 64, 96, generator=g).bfloat16()
    out, (dx, dweight) = _grads(lambda a, w: rms_norm(a, w, 1e-6), x, weight, upstream=upstream)
    x32 = x.float()
    hugging_face = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * weight
    assert torch.equal(out, hugging_face)  # the forward is LlamaRMSNorm's, op for op

    # exact: the same function in float64 (x̂ rounded to bf16 as the forward multiplies it)
    x64, w64 = x.double().requires_grad_(), weight.double().requires_grad_()
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    (x64 * rstd * w64).backward(upstream.double())
    assert dx.dtype == torch.bfloat16 and dweight.dtype == torch.bfloat16
    assert _relative(dx, x64.grad) <= 2 * BF16_UNIT_ROUNDOFF
    assert _relative(dweight, w64.grad) <= 2 * BF16_UNIT_ROUNDOFF


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_gradients_are_the_composites_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(1)
    gate, up, upstream = (torch.randn(8, 48, generator=g).to(dtype) for _ in range(3))
    out, grads = _grads(swiglu, gate, up, upstream=upstream)
    want_out, want_grads = _grads(lambda a, b: F.silu(a) * b, gate, up, upstream=upstream)
    assert torch.equal(out, want_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
