"""Ring attention (ours) over the load-balanced sequence layout of parallel/context/apply.py.

Each cp rank holds two chunks of every sequence, chunk r and chunk 2·cp−1−r (of 2·cp), so its local
sequence is [early half | late half] and positions rise along it. K/V blocks travel around the ring
(rank r sends to r+1) with their own grouped-query head count, the next block's transfer running
while the current block is attended. Against the block that started on rank `src`:

  src == rank  the local causal block (positions rise along the local sequence);
  src <  rank  every query sees the block's early half; its late half is in every query's future;
  src >  rank  only the late-half queries see anything, and they see the whole block.

So each step but the first is exactly half a square of work, on every rank: fully masked quarters
are never computed. Partial results merge exactly with the log-sum-exp rule.

Backward runs the ring again: K/V travel as in forward and, one step behind, the gradient of each
K/V block travels with it, each rank adding its part; after cp steps it is back at its owner.

Document masking: every rank all-gathers the document ids of the whole sequence once per call
(a few bytes per token) and masks each block by its rows' and columns' ids
(attention_blocks.document_block); a block no query of which may see is skipped, though its K/V
and gradient still travel so that every rank runs the same ring.

Sliding windows and sinks (parallel/context/windows.py): with a window each step's work is a block
per pair of chunks, skipped when it lies outside the window and trimmed where it crosses it; the
sinks join the merged log-sum-exp once, after the ring.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fivefold.models.attention.blocks import merge_rows
from fivefold.models.attention.windows import Block, part_backward, part_forward, visible_parts
from fivefold.parallel.context.windows import BlockMethod, BlockwiseAttention, chunk_blocks

_KV_TAG, _GRAD_TAG = 0, 1  # gloo matches messages by tag; NCCL by issue order (the same on all ranks)


class InFlight:
    """A posted send/receive pair; `wait()` returns the received tensor. Waits end or raise at the
    process group's timeout."""

    def __init__(self, works, received: torch.Tensor):
        self.works, self.received = works, received

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


class Ring:
    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def pass_along(self, tensor: torch.Tensor, tag: int) -> InFlight:
        """Send `tensor` to the next rank and receive the previous rank's, without waiting."""
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, group=self.group, group_peer=self.next, tag=tag),
               dist.P2POp(dist.irecv, received, group=self.group, group_peer=self.prev, tag=tag)]
        return InFlight(dist.batch_isend_irecv(ops), received)


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V side by side along the head dim, (b, kv_heads, L, d_k + d_v): one message, and V's
    head dim may differ from K's (Multi-head Latent Attention)."""
    return torch.cat((k, v), dim=-1).contiguous()


def gather_documents(documents: torch.Tensor, group) -> torch.Tensor:
    """(cp, b, L): every cp rank's local document ids (b, L), by rank."""
    parts = [torch.empty_like(documents) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, documents.contiguous(), group=group)
    return torch.stack(parts)


def ring_block(rank: int, src: int, half: int) -> tuple[slice, slice, bool]:
    """(query rows, key columns, causal) of this rank's work against the K/V block of rank `src`."""
    if src == rank:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def ring_step_blocks(rank: int, src: int, cp: int, half: int, window: int) -> list[Block]:
    """This rank's blocks against rank `src`'s K/V: one (`ring_block`) without a window; with one,
    a block per pair of chunks, with positions, so that the window can skip and trim each."""
    if not window:
        return [Block(*ring_block(rank, src, half))]
    return chunk_blocks([(0, rank), (half, 2 * cp - 1 - rank)], [(0, src), (half, 2 * cp - 1 - src)], half)


def ring_forward(q, k, v, group, documents=None, by_rank=None, window: int = 0,
                 counts=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output fp32, LSE fp32 (b, h, L)) of this rank's queries against the whole sequence;
    `documents` (b, L) this rank's document ids, `by_rank` every rank's (gather_documents)."""
    ring = Ring(group)
    scale = q.shape[-1] ** -0.5
    half = q.shape[2] // 2
    kv, d = pack_kv(k, v), k.shape[-1]  # one message per step
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    for step in range(ring.size):
        incoming = ring.pass_along(kv, _KV_TAG) if step < ring.size - 1 else None
        src = (ring.rank - step) % ring.size
        for block in ring_step_blocks(ring.rank, src, ring.size, half, window):
            # No part when nothing of it is seen: not computed (step 0's causal block always is).
            keys = None if documents is None else by_rank[src]
            for part, mask in visible_parts(block, window, q.device, documents, keys, counts):
                block_out, block_lse = part_forward(q, kv[..., :d], kv[..., d:], part, scale, mask)
                merge_rows(out, lse, part.rows, block_out, block_lse)
        if incoming is not None:
            kv = incoming.wait()
    return out, lse


def ring_backward(dout, q, k, v, out, lse, group, documents=None, by_rank=None, window: int = 0):
    """(dq, dk, dv) of this rank's q, k, v, given the final output and LSE of its queries."""
    ring = Ring(group)
    scale = q.shape[-1] ** -0.5
    half = q.shape[2] // 2
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv, d = pack_kv(k, v), k.shape[-1]
    grads_in_flight = None
    for step in range(ring.size):
        incoming = ring.pass_along(kv, _KV_TAG) if step < ring.size - 1 else None
        src = (ring.rank - step) % ring.size
        # fp32 on the wire: the sum over cp ranks is an accumulation like dq's.
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for block in ring_step_blocks(ring.rank, src, ring.size, half, window):
            keys = None if documents is None else by_rank[src]
            for part, mask in visible_parts(block, window, q.device, documents, keys):
                dq_block, dk_block, dv_block = part_backward(dout, q, kv[..., :d], kv[..., d:], out, lse,
                                                             part, scale, mask)
                dq[:, :, part.rows] += dq_block
                dkv[..., part.cols, :d] += dk_block
                dkv[..., part.cols, d:] += dv_block
        if grads_in_flight is not None:  # the previous ranks' part for this same block
            dkv += grads_in_flight.wait()
        grads_in_flight = ring.pass_along(dkv, _GRAD_TAG)
        if incoming is not None:
            kv = incoming.wait()
    dkv = grads_in_flight.wait()  # this rank's own block, with every rank's part
    return dq.to(q.dtype), dkv[..., :d].to(k.dtype), dkv[..., d:].to(v.dtype)


RING = BlockMethod(gather_documents, ring_forward, ring_backward)


def ring_attention(q, k, v, group, documents=None, window: int = 0, sinks=None, counts=None) -> torch.Tensor:
    """`documents` (b, L): this rank's tokens' document ids, to keep attention inside documents;
    `window`: the keys a query sees at most (0: all earlier ones); `sinks` (h,): the heads' sink
    logits; `counts`: a Counter of computed and skipped blocks (parallel/context/windows.py)."""
    return BlockwiseAttention.apply(q, k, v, sinks, RING, group, documents, window, counts)
