"""The output projections of a block's residual branches (attention's and the MLP's), as an
operator of their own, so that selective recomputation can keep them from holding their output.

Selective recomputation (parallel/recompute.py) saves the outputs of matrix multiplies for
backward. For the projections that write into the residual stream that output is the wrong thing
to keep: nothing in backward needs it (the weight gradient needs the projection's input), and under
tensor parallelism it is the whole-sequence partial sum before the reduce-scatter, tp times the
size of the stream it becomes. It was the largest share of what a block kept (benchmarks/RESULTS.md,
"Activation memory against Korthikanti et al."). As `fivefold::stream_projection` the projection is
an operator the recomputation policy can tell apart from the other matrix multiplies (also under
torch.compile, which sees it as one opaque op), and `keep_projection_inputs` keeps its inputs
as they are rather than handing them to the checkpoint: recomputing a branch in backward then stops
before the projection instead of running it again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks


@torch.library.custom_op("fivefold::stream_projection", mutates_args=())
def stream_projection(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x Wᵀ (no bias) in x's dtype. The weight is given in its own dtype (fp32 under autocast) and
    cast here, not outside: what backward keeps is then the weight itself, not a compute-dtype
    copy per micro-batch."""
    return F.linear(x, weight.to(x.dtype))


@stream_projection.register_fake
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x = grad @ weight.to(grad.dtype) if ctx.needs_input_grad[0] else None
    grad_weight = None
    if ctx.needs_input_grad[1]:  # accumulated in the compute dtype, handed back in the weight's
        grad_weight = (grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])).to(weight.dtype)
    return grad_x, grad_weight


stream_projection.register_autograd(_backward, setup_context=_setup_context)


def project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """stream_projection with x in autocast's compute dtype (autocast does not cast custom
    operators)."""
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    return stream_projection(x, weight)


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def keep_projection_inputs(forward):
    """`forward` (a projection module's) with the tensors it saves for backward kept as they are.

    Inside a checkpointed branch every saved tensor is packed by the checkpoint and recreated by
    running the branch again; the innermost saved-tensor hooks win, so under these the projection's
    input (the attention output, whose storage the policy keeps anyway, or the SwiGLU product) and
    its weight (the parameter itself, see stream_projection) are kept instead. The checkpoint then has
    nothing to recreate at or after the projection, and its recomputation stops before it.
    torch.compile's partitioner decides what to save itself (it never recomputes an output nobody
    reads), so compiled code runs the projection plainly."""
    def wrapped(*args, **kwargs):
        if torch.compiler.is_compiling():
            return forward(*args, **kwargs)
        with saved_tensors_hooks(_as_is, _as_is):
            return forward(*args, **kwargs)
    return wrapped
