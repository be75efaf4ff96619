"""The output layer and its cross-entropy in one, chunked over tokens: never a micro-batch's logits.

Training needs the logits only to turn them into a loss, yet `output(x)` makes all of them (tokens ×
vocab, 2 GiB in bf16 at 8,192 tokens of a 128K vocabulary) and keeps them until backward. Here the
tokens are taken a chunk at a time (models/loss/cross_entropy.py `chunk_tokens`: one chunk's fp32 logits
at most 32 MiB):

- forward: each chunk's logits x_c Wᵀ in the compute dtype (as the output layer rounds them), then
  per token the fp32 log-sum-exp and the target's logit; the chunk's logits are dropped;
- backward: each chunk's logits again (one more x_c Wᵀ: the price of not keeping them, a third of
  the output layer's matmuls), g_c = (softmax − one-hot) × the incoming gradient, rounded to the
  compute dtype as autograd's cast of an fp32 loss's gradient would round it, then
  dx_c = g_c W and dW += g_cᵀ x_c, dW summed over the chunks in fp32.

Saved for backward: x, W (both held by their owners anyway), the per-token fp32 log-sum-exp and the
targets. The result is the *sum* of the cross-entropies over the positions with a target (the mean,
or a loss mask's scaling, is the caller's: parallel/loss.py), an fp32 scalar.

The vocabulary may be split over processes as in models/loss/cross_entropy.py (`shard`: W holds the rows
from `shard.first`, `shard.max` / `shard.sum` reduce over the processes holding the others): the
per-token log-sum-exp and target logit are combined with one max and one sum in forward; backward
needs no communication here, and dx is this process's share of the sum (the caller's layout sums it,
as it sums a column-split layer's input gradient).
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.models.loss.cross_entropy import IGNORE, chunk_tokens, combine_shards, target_columns


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = IGNORE, shard=None, chunk: int | None = None) -> torch.Tensor:
    """Σ over positions whose target is not `ignore_index` of cross_entropy(x Wᵀ, target), as
    F.cross_entropy(F.linear(x, W).float(), targets, reduction="sum") computes it, without the
    logits (module doc). x (..., dim) in the compute dtype, W (vocab, dim) in any float dtype (cast
    to x's, as autocast would), targets (...) of x's leading shape; an fp32 scalar."""
    dim = x.shape[-1]
    flat = x.reshape(-1, dim)
    if chunk is None:
        chunk = chunk_tokens(flat.shape[0], weight.shape[0])
    return _LinearCrossEntropy.apply(flat, weight, targets.reshape(-1), ignore_index, chunk, shard)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, ignore_index: int, chunk: int, shard):
        n, vocab = x.shape[0], weight.shape[0]
        first = shard.first if shard is not None else 0
        valid, column, here = target_columns(targets, ignore_index, first, vocab)
        w = weight.to(x.dtype)
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        target_logit = torch.empty(n, dtype=torch.float32, device=x.device)
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                logits = (x[start:end] @ w.t()).float()
                target_logit[start:end] = logits.gather(1, column[start:end, None]).squeeze(1)
                top = logits.amax(dim=1)
                lse[start:end] = logits.sub_(top[:, None]).exp_().sum(dim=1).log_().add_(top)
                del logits
            lse, target_logit = combine_shards(lse, torch.where(here, target_logit, 0.0), shard)
            total = torch.where(valid, lse - target_logit, 0.0).sum()
        ctx.save_for_backward(x, weight, targets, lse)
        ctx.ignore_index, ctx.chunk, ctx.first = ignore_index, chunk, first
        ctx.mark_non_differentiable(targets)
        return total

    @staticmethod
    def backward(ctx, grad):
        x, weight, targets, lse = ctx.saved_tensors
        n, vocab = x.shape[0], weight.shape[0]
        valid, column, here = target_columns(targets, ctx.ignore_index, ctx.first, vocab)
        scale = torch.where(valid, grad.float(), 0.0)  # (n,): d loss / d a token's cross-entropy
        one = here.to(torch.float32)[:, None]
        w = weight.to(x.dtype)
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            for start in range(0, n, ctx.chunk):
                end = min(start + ctx.chunk, n)
                logits = (x[start:end] @ w.t()).float()
                softmax = logits.sub_(lse[start:end, None]).exp_()
                softmax.scatter_add_(1, column[start:end, None], -one[start:end])
                g = softmax.mul_(scale[start:end, None]).to(x.dtype)
                del logits, softmax
                if grad_x is not None:
                    torch.mm(g, w, out=grad_x[start:end])
                if grad_w is not None:
                    grad_w.add_(g.t() @ x[start:end])
                del g
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, None, None, None, None


class OutputLayer(nn.Linear):
    """The model's output projection (dim -> vocabulary, no bias). Called with the hidden states
    alone it returns the logits; with `targets` too, the summed cross-entropy of the logits it
    would return, computed without them (`linear_cross_entropy`). The loss is computed here, in
    the layer's own forward, so that whatever a layout wraps around the layer's call (FSDP's
    gathering of the weight) holds for it; a layout replacing the layer keeps both forms
    (parallel/tensor/layers.py VocabParallelOutput)."""

    def __init__(self, dim: int, vocab_size: int):
        super().__init__(dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        return linear_cross_entropy(x, self.weight, targets)
