"""Causal attention with what SDPA's causal flag cannot say: a sliding window (a query sees at most
`window` keys, itself included), attention sinks (one learned logit per head that joins every
query's softmax denominator, as a key whose value is zero) and document masks (models/attention/documents.py).

Blockwise, never quadratic. The sequence is cut into chunks of `CHUNK` positions; each query chunk
attends the key chunks at or before it, each pair a block of models/attention/blocks.py:
  - a block no query of which sees a key (outside the window, or in other documents) is skipped,
    and key chunks before the window's or the first row's document's start are not even visited;
  - a block the window or a document boundary crosses is trimmed to what the window shows and
    masked with a block-sized boolean mask, which CPU's flash kernel takes (as an additive mask);
    where no kernel takes a mask (CUDA's memory-efficient kernel; V's head dim other than Q's on
    CPU) a block the window crosses is instead cut into tiles that need none when the window and
    the chunk share a divisor of 16 or more (a causal tile, whole tiles, a mirrored causal tile);
  - whole blocks side by side in one row of tiles are joined into one kernel call;
  - every block runs PyTorch's fused attention kernel that returns the log-sum-exp (flash on CPU,
    computed in fp32; memory-efficient on CUDA), or plain PyTorch tiled over rows where the kernel
    cannot; the blocks merge exactly by log-sum-exp (fp32), and the sinks join the merged
    log-sum-exp once: LSE ← logaddexp(LSE, sink), the output scaled by exp(LSE_before − LSE_after),
    and their gradient is −Σ_rows P_sink · rowsum(dO ∘ O).
Forward keeps only q, k, v, the output and the fp32 log-sum-exp per row (O(seq)); backward
recomputes each block from them (a custom autograd Function, as flash attention does), so neither
pass builds a (seq, seq) tensor: the largest transient is a block's (CHUNK, CHUNK + window) scores
or mask. Without a window or documents (a window ≥ seq counts as none) it is one causal block: the
whole sequence through the fused kernel, the sinks folded in after it. With bf16 inputs the blocks
compute in fp32 and the output is rounded once; backward reads the bf16 output (as flash
attention does), so gradients are within bf16 rounding of the fp32 ones.

The context-parallel methods (parallel/context/) run the same block rules over their chunks; this
module knows nothing of them. It runs eagerly: under torch.compile it is a graph break.

FlexAttention (torch.nn.attention.flex_attention) is not used here: torch 2.13 has no CPU backward
for it, and its eager forward materialises the (batch, heads, seq, seq) scores (measured: 209 MiB
peak for 4 heads at seq 2048, where one fp32 (heads, seq, seq) tensor is 64 MiB); only compiled on
CUDA does it tile, and there the document-only case goes through it (models/attention/documents.py).

`allowed_keys` and `sink_attention` are the plain reference (quadratic; tests only).
"""

from __future__ import annotations

import torch

from fivefold.models.attention.blocks import merge_rows, use_cpu_flash_kernel
from fivefold.models.attention.windows import Block, add_sinks, part_backward, part_forward, sink_grad, visible_parts

# Positions per block: large enough that a block's kernel call outweighs Python's loop, small
# enough that a block's transient scores (CHUNK² per head) stay in cache and far below seq².
CHUNK = 128


def allowed_keys(seq: int, device, window: int = 0, documents: torch.Tensor | None = None) -> torch.Tensor:
    """(batch or 1, 1, seq, seq) bool, True where query i may see key j: j <= i, i - j < window
    (window 0: any distance), and both in one document when `documents` (batch, seq) is given.
    Quadratic: the reference for tests, never used in training."""
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    allowed = j <= i
    if window:
        allowed = allowed & (i - j < window)
    allowed = allowed[None, None]
    if documents is not None:
        allowed = allowed & (documents[:, :, None] == documents[:, None, :])[:, None]
    return allowed


def _document_starts(documents: torch.Tensor) -> list[int]:
    """Per position, the earliest start (over the batch) of the document it lies in: keys before
    it are in another document for every row of the batch."""
    seq = documents.shape[-1]
    index = torch.arange(seq, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return first.min(0).values.tolist()


def _join_whole(parts: list[tuple[Block, torch.Tensor | None]]) -> list[tuple[Block, torch.Tensor | None]]:
    """Whole (unmasked, non-causal) parts of the same rows whose columns meet, as one part."""
    joined: list[tuple[Block, torch.Tensor | None]] = []
    last_whole: dict[tuple[int, int], int] = {}  # rows -> index in `joined` of its last whole part
    for part, mask in parts:
        whole = mask is None and not part.causal and not part.mirrored
        key = (part.rows.start, part.rows.stop)
        if whole and key in last_whole:
            index = last_whole[key]
            previous = joined[index][0]
            if previous.cols.stop == part.cols.start:
                joined[index] = (Block(previous.rows, slice(previous.cols.start, part.cols.stop), False,
                                       previous.q_start, previous.k_start), None)
                continue
        if whole:
            last_whole[key] = len(joined)
        joined.append((part, mask))
    return joined


def attention_parts(seq: int, window: int, documents: torch.Tensor | None, device,
                    chunk: int = CHUNK, tiles: bool = True) -> list[tuple[Block, torch.Tensor | None]]:
    """The (block, mask or None) parts of causal attention over `seq` positions under the window
    (0: none) and documents (batch, seq) or None; every mask is at most (batch, chunk, chunk).
    `tiles`: cut blocks the window crosses into unmasked tiles where it can (else masked blocks)."""
    if window >= seq:
        window = 0
    if not window and documents is None:
        return [(Block(slice(0, seq), slice(0, seq), True), None)]
    doc_starts = None if documents is None else _document_starts(documents)
    parts = []
    for q_start in range(0, seq, chunk):
        q_stop = min(seq, q_start + chunk)
        rows = slice(q_start, q_stop)
        first_key = 0 if not window else max(0, q_start - window + 1)
        if doc_starts is not None:
            first_key = max(first_key, doc_starts[q_start])
        for k_start in range(first_key // chunk * chunk, q_start + 1, chunk):
            k_stop = q_stop if k_start == q_start else k_start + chunk
            block = Block(rows, slice(k_start, k_stop), k_start == q_start, q_start, k_start)
            parts.extend(visible_parts(block, window, device, documents, documents, tiles=tiles))
    return _join_whole(parts)


def _tiles(q, v) -> bool:
    """Whether to cut windowed blocks into unmasked tiles: not where CPU's flash kernel takes the
    block's mask itself (one call instead of a few small ones, faster on CPU)."""
    return not use_cpu_flash_kernel(q, v)


class BlockwiseMaskedAttention(torch.autograd.Function):
    """Blockwise attention with the sinks folded in once; backward recomputes each block."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, window: int, documents, chunk: int):
        scale = q.shape[-1] ** -0.5
        parts = attention_parts(q.shape[2], window, documents, q.device, chunk, _tiles(q, v))
        if len(parts) == 1:  # one causal block over every row: nothing to merge
            out, lse = part_forward(q, k, v, parts[0][0], scale, parts[0][1], mask_kernel=True)
        else:
            out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float32, device=q.device)
            lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
            for part, mask in parts:
                block_out, block_lse = part_forward(q, k, v, part, scale, mask, mask_kernel=True)
                merge_rows(out, lse, part.rows, block_out, block_lse)
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.window, ctx.documents, ctx.chunk = window, documents, chunk
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        for part, mask in attention_parts(q.shape[2], ctx.window, ctx.documents, q.device, ctx.chunk, _tiles(q, v)):
            dq_part, dk_part, dv_part = part_backward(dout, q, k, v, out, lse, part, scale, mask, mask_kernel=True)
            dq[:, :, part.rows] += dq_part
            dk[:, :, part.cols] += dk_part
            dv[:, :, part.cols] += dv_part
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None


@torch.compiler.disable  # a Python loop over blocks, and custom autograd: leave it out of graphs
def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
                     documents: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                     chunk: int = CHUNK) -> torch.Tensor:
    """Attention over (batch, heads, seq, head_dim); k/v may have fewer heads (GQA), v another head
    dim. `window`: the keys a query sees at most (0: all earlier ones); `documents` (batch, seq):
    each token's document id, or None; `sinks` (heads,): the heads' sink logits, or None."""
    # The blocks accumulate in fp32 themselves; under bf16 autocast their matmuls would not.
    with torch.autocast(q.device.type, enabled=False):
        return BlockwiseMaskedAttention.apply(q, k, v, sinks, window, documents, chunk)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   sinks: torch.Tensor) -> torch.Tensor:
    """softmax([q kᵀ/sqrt(d), sink]) without the sink's column, times v; fp32 inside (transformers'
    eager gpt-oss attention computes the same). The plain reference: it materialises the
    (batch, heads, seq, seq) scores, so tests only. The query heads of a kv head are one broadcast
    dimension, so k and v are never copied per query head."""
    batch, heads, seq, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    with torch.autocast(q.device.type, enabled=False):
        qg = q.float().view(batch, kv_heads, group, seq, head_dim)
        scores = qg @ k.float()[:, :, None].transpose(-1, -2) * head_dim ** -0.5  # (b, kv, g, s, s)
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
        sink = sinks.float().view(1, kv_heads, group, 1, 1).expand(batch, -1, -1, seq, 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]  # every row has its finite sink
        out = probs @ v.float()[:, :, None]  # (b, kv, g, s, v_head_dim)
    return out.view(batch, heads, seq, -1).to(q.dtype)
