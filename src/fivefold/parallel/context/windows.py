"""Sliding windows and attention sinks in context-parallel attention (ours). The block rules below
live in models/attention/windows.py (parallelism-free, shared with the single-device attention).

Windows. Context parallelism computes attention a block at a time: query rows of one chunk of the
sequence against key columns of another. A block outside the window is skipped, never computed, but
its K/V still travel, so that every rank runs the same ring; how the window cuts the other blocks
(tiles the fused kernels run, a trimmed masked block, or the whole block) is
models/attention/windows.py's rule, shared with the single-device attention.
The three attention methods describe their blocks as `Block`s with the global positions of their
first row and column (chunks are contiguous runs of positions), so one rule serves them all.

Sinks. A sink is one logit per head that joins every query's softmax denominator as a key whose
value is zero. It must join the log-sum-exp merge exactly once, not once per block: the blocks are
merged without it, then `add_sinks` folds it in, LSE ← logaddexp(LSE, sink) and the output scaled
by exp(LSE_before − LSE_after). The backward of each block is then the ordinary one given that
final output and LSE (the probabilities exp(score − LSE) are the true ones), and the sink's own
gradient is −Σ_rows P_sink · rowsum(dO ∘ O), summed over this rank's rows (`sink_grad`); the sum
over cp ranks is the usual gradient reduction of a replicated parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fivefold.models.attention.windows import Block, add_sinks, sink_grad


def chunk_blocks(query_chunks, key_chunks, chunk: int) -> list[Block]:
    """The blocks of query chunks against key chunks, each given as (first local row or column,
    global chunk index): a key chunk before the query chunk is seen whole, the same chunk
    causally, a later one not at all. Causal blocks come first for their rows."""
    blocks = []
    for row, q_index in query_chunks:
        rows = slice(row, row + chunk)
        for col, k_index in sorted(key_chunks, key=lambda c: c[1] != q_index):
            if k_index <= q_index:
                blocks.append(Block(rows, slice(col, col + chunk), k_index == q_index,
                                    q_index * chunk, k_index * chunk))
    return blocks


@dataclass(frozen=True)
class BlockMethod:
    """A context-parallel method that attends block by block (ring, all-gather): how it gathers the
    keys' document ids, `documents_of(documents, group)`, and its forward and backward,
    `forward(q, k, v, group, documents, key_documents, window, counts)` -> (out fp32, LSE) and
    `backward(dout, q, k, v, out, lse, group, documents, key_documents, window)` -> (dq, dk, dv)."""

    documents_of: Callable
    forward: Callable
    backward: Callable


class BlockwiseAttention(torch.autograd.Function):
    """A BlockMethod's attention with the sinks folded in once, after its blocks are merged."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, method: BlockMethod, group, documents, window, counts):
        keys = None if documents is None else method.documents_of(documents, group)
        out, lse = method.forward(q, k, v, group, documents, keys, window, counts)
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.method, ctx.group, ctx.documents, ctx.keys, ctx.window = method, group, documents, keys, window
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = ctx.method.backward(dout, q, k, v, out, lse, ctx.group, ctx.documents, ctx.keys, ctx.window)
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        return dq, dk, dv, dsinks, None, None, None, None, None
