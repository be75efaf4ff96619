"""Cross-entropy over a vocabulary, chunked over tokens: never the fp32 logits of every token.

`F.cross_entropy(logits.float(), ...)` on a micro-batch's logits (tokens, vocab) holds an fp32 copy
of them, saves their fp32 log-softmax for backward and builds an fp32 gradient of the same size
(then its cast to the logits' dtype): three to four times the whole fp32 logits beyond the logits
themselves, 4.2 GB each at 8,192 tokens of a 128K vocabulary. Here the tokens are taken a chunk at
a time, each chunk cast to fp32 on its own:

- forward: per token the log-sum-exp and the target's logit, both fp32 (a few bytes per token);
  the loss is Σ (lse - target logit) over the positions with a target;
- backward: per chunk the fp32 softmax exp(x - lse), minus one at the target, times the incoming
  gradient, written in the logits' dtype (as autograd's cast back from fp32 would write it).

Saved for backward: the logits themselves (already held by whoever made them), the per-token lse
and the labels. With `overwrite=True` the gradient is written into the logits' own storage, chunk
by chunk, and returned as their gradient: the loss then adds nothing beyond one chunk's fp32
temporaries. That is for a caller handing over logits nothing else reads afterwards (a training
step's model output: the output projection's backward reads its input and weight, not its output);
autograd's version counter turns any other reader of the overwritten logits into an error, not a
wrong number. Leaves are never overwritten.

The vocabulary may be split over processes (`shard`: this process's columns begin at `shard.first`,
and `shard.max` / `shard.sum` reduce a tensor over the processes holding the other columns): each
process then computes on its own columns, the per-token lse and target logit are combined with one
max and one sum over them in forward, and backward needs no communication (Megatron's vocabulary-
parallel cross-entropy). What a `shard` is made of is the caller's business.
"""

from __future__ import annotations

import math

import torch

IGNORE = -100  # the label of a position without a target (F.cross_entropy's default ignore_index)

# fp32 elements of one chunk's temporaries (32 MiB); and at most this share of the tokens per chunk,
# so a small micro-batch is still taken in several chunks.
CHUNK_ELEMENTS = 1 << 23
CHUNKS_AT_LEAST = 8
# Logits of at most this many elements (4 MiB in fp32) are taken whole: there the chunk loop's
# per-chunk kernels cost more time than the copy's memory is worth (1024 tokens of a 256-token
# vocabulary, forward and backward on one CPU thread: 0.94 ms in 8 chunks, 0.71 ms whole).
WHOLE_ELEMENTS = 1 << 20


def chunk_tokens(n_tokens: int, vocab: int) -> int:
    """Tokens per chunk for a (n_tokens, vocab) slice of logits: all of them up to WHOLE_ELEMENTS
    values, else at most CHUNK_ELEMENTS fp32 values and at most 1/CHUNKS_AT_LEAST of the tokens,
    at least one token."""
    if n_tokens * vocab <= WHOLE_ELEMENTS:
        return max(1, n_tokens)
    return max(1, min(CHUNK_ELEMENTS // max(vocab, 1), math.ceil(n_tokens / CHUNKS_AT_LEAST)))


def chunked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean",
                          ignore_index: int = IGNORE, chunk: int | None = None, overwrite: bool = False,
                          shard=None) -> torch.Tensor:
    """F.cross_entropy(logits.float() flattened to (tokens, vocab), labels flattened, ignore_index,
    reduction) for reduction "mean" (over the positions with a target) or "sum", computed chunk by
    chunk (module doc). `logits` (..., vocab) in any float dtype, `labels` (...) of the same leading
    shape; returns an fp32 scalar."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"chunked_cross_entropy takes reduction 'mean' or 'sum', not '{reduction}'")
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    targets = labels.reshape(-1)
    if chunk is None:
        chunk = chunk_tokens(flat.shape[0], vocab)
    # Only a non-leaf whose flat form is its own storage can take its gradient in place.
    overwrite = overwrite and logits.grad_fn is not None and flat.data_ptr() == logits.data_ptr() \
        and flat.is_contiguous()
    return _ChunkedCrossEntropy.apply(flat, targets, reduction == "mean", ignore_index, chunk, overwrite, shard)


def target_columns(targets: torch.Tensor, ignore_index: int, first: int, vocab: int):
    """(positions with a target, each target's column among this process's `vocab` columns from
    `first` (0 where not here), whether the target is one of them)."""
    valid = targets != ignore_index
    column = targets - first
    here = valid & (column >= 0) & (column < vocab)
    return valid, torch.where(here, column, 0), here


def combine_shards(lse: torch.Tensor, target_logit: torch.Tensor, shard) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-sum-exp and target logit over the whole vocabulary from each process's share
    (the target logit 0 where the target is not among its columns): one max, one sum. Unchanged
    without a shard."""
    if shard is None:
        return lse, target_logit
    top = shard.max(lse.clone())
    summed = shard.sum(torch.stack([(lse - top).exp_(), target_logit]))
    return summed[0].log_().add_(top), summed[1]


def _fp32(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """x in fp32, and whether that is a copy of its own (which may then be changed in place)."""
    return (x, False) if x.dtype == torch.float32 else (x.float(), True)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, targets, mean: bool, ignore_index: int, chunk: int, overwrite: bool, shard):
        n, vocab = x.shape
        first = shard.first if shard is not None else 0
        valid, column, here = target_columns(targets, ignore_index, first, vocab)
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        target_logit = torch.empty(n, dtype=torch.float32, device=x.device)
        with torch.no_grad():
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                c, own = _fp32(x[start:end])
                target_logit[start:end] = c.gather(1, column[start:end, None]).squeeze(1)
                top = c.amax(dim=1)
                shifted = c.sub_(top[:, None]) if own else c - top[:, None]
                lse[start:end] = shifted.exp_().sum(dim=1).log_().add_(top)
                del c, shifted
            lse, target_logit = combine_shards(lse, torch.where(here, target_logit, 0.0), shard)
            per_token = torch.where(valid, lse - target_logit, 0.0)
            total = per_token.sum()
            divisor = valid.sum() if mean else None
            loss = total / divisor if mean else total
        ctx.save_for_backward(x, targets, lse)
        ctx.mean, ctx.ignore_index, ctx.chunk, ctx.overwrite, ctx.first = mean, ignore_index, chunk, overwrite, first
        ctx.divisor = divisor
        ctx.mark_non_differentiable(targets)
        return loss

    @staticmethod
    def backward(ctx, grad):
        x, targets, lse = ctx.saved_tensors
        n, vocab = x.shape
        valid, column, here = target_columns(targets, ctx.ignore_index, ctx.first, vocab)
        scale = grad.float() / ctx.divisor if ctx.mean else grad.float()
        weight = torch.where(valid, scale, 0.0)  # (n,): d loss / d per-token loss
        one = here.to(torch.float32)[:, None]
        in_place = ctx.overwrite and not torch.is_grad_enabled()
        out = x if in_place else torch.empty_like(x)
        for start in range(0, n, ctx.chunk):
            end = min(start + ctx.chunk, n)
            c, own = _fp32(x[start:end])
            shifted = c.sub_(lse[start:end, None]) if own else c - lse[start:end, None]
            softmax = shifted.exp_()
            softmax.scatter_add_(1, column[start:end, None], -one[start:end])
            softmax.mul_(weight[start:end, None])
            out[start:end].copy_(softmax)
            del c, shifted, softmax
        return out, None, None, None, None, None, None
