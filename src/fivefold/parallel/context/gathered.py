"""The two collective-based context-parallel attentions (ours), over the layout of parallel/context/apply.py.

- All-gather (as in Llama 3): every rank all-gathers K/V (with their own kv head count), attends
  its two query chunks to the keys at or before them, and reduce-scatters dK/dV in backward. K/V
  are gathered again in backward rather than kept, so only the local K/V are saved.
- Ulysses: one all-to-all turns sequence-split q/k/v into head-split whole sequences, ordinary
  causal attention runs on cp-th of the heads, and one all-to-all turns the output back.

Document masking: both all-gather the document ids of the whole sequence (a few bytes per token).
All-gather masks each block of its local queries against the gathered keys and skips blocks no
query may see; Ulysses runs the model's own document-masked attention on the whole sequence.

Sliding windows and sinks: all-gather skips and trims its blocks by the window and folds the sinks
into the merged log-sum-exp once (parallel/context/windows.py); Ulysses hands both to the model's
masked attention (models/attention/masked.py), each rank its heads' sinks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fivefold.models.attention.documents import document_attention
from fivefold.models.attention.masked import masked_attention
from fivefold.parallel.context.apply import gathered_chunk_order, local_positions
from fivefold.parallel.context.ring import gather_documents, pack_kv
from fivefold.models.attention.blocks import merge_rows
from fivefold.models.attention.windows import Block, part_backward, part_forward, visible_parts
from fivefold.parallel.context.windows import BlockMethod, BlockwiseAttention, chunk_blocks

# torch 2.13 renamed the single-tensor collectives; keep working on 2.11/2.12.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---- all-gather ----------------------------------------------------------------------------------

def _gather_kv(k, v, group) -> torch.Tensor:
    """(b, kv_heads, seq, d_k + d_v): every rank's K and V side by side (pack_kv), in sequence order."""
    return gather_sequence(pack_kv(k, v), group)


def gather_sequence(local: torch.Tensor, group) -> torch.Tensor:
    """(b, heads, seq, d): every cp rank's (b, heads, L, d) in sequence order (no autograd)."""
    cp = dist.get_world_size(group)
    local = local.contiguous()
    gathered = local.new_empty((cp * local.shape[0],) + local.shape[1:])  # gloo wants ranks along dim 0, flat
    _all_gather(gathered, local, group=group)
    gathered = gathered.unflatten(0, (cp, -1))  # (cp, b, hkv, L, d)
    chunks = gathered.movedim(0, 2).unflatten(3, (2, -1)).flatten(2, 3)  # (b, hkv, 2cp, c, d)
    in_order = torch.tensor(gathered_chunk_order(cp), device=local.device).argsort()
    return chunks.index_select(2, in_order).flatten(2, 3)


def sequence_documents(documents, group) -> torch.Tensor:
    """(b, seq): the document ids of the whole sequence, in sequence order, from each rank's (b, L)."""
    cp, local_len = dist.get_world_size(group), documents.shape[1]
    slots = gather_documents(documents, group).movedim(0, 1).flatten(1, 2)  # rank 0's tokens, rank 1's...
    positions = torch.cat([local_positions(r, cp, local_len, documents.device) for r in range(cp)])
    whole = torch.empty_like(slots)
    whole[:, positions] = slots
    return whole


def _scatter_kv_grads(dkv_whole: torch.Tensor, group) -> torch.Tensor:
    """Sum every rank's gradient of the whole packed K/V and keep this rank's part: (b, hkv, L, d)."""
    cp = dist.get_world_size(group)
    chunks = dkv_whole.unflatten(2, (2 * cp, -1))
    slots = chunks.index_select(2, torch.tensor(gathered_chunk_order(cp), device=dkv_whole.device))
    per_rank = slots.unflatten(2, (cp, 2)).flatten(3, 4).movedim(2, 0).contiguous()  # (cp, b, hkv, L, d)
    mine = per_rank.new_empty(per_rank.shape[1:])
    _reduce_scatter(mine, per_rank.flatten(0, 1), group=group)
    return mine


def _allgather_blocks(rank: int, cp: int, chunk: int, window: int) -> list[Block]:
    """This rank's blocks: each local chunk sees every earlier key fully and its own chunk
    causally; keys after it are never touched. With a window, a block per pair of chunks (with
    positions), so that the window can skip and trim each."""
    mine = [(0, rank), (chunk, 2 * cp - 1 - rank)]
    if window:
        return chunk_blocks(mine, [(c * chunk, c) for c in range(2 * cp)], chunk)
    blocks = []
    for row, index in mine:
        rows, start = slice(row, row + chunk), index * chunk
        blocks.append(Block(rows, slice(start, start + chunk), True))
        if start > 0:
            blocks.append(Block(rows, slice(0, start), False))
    return blocks


def _visible_blocks(rank, cp, q, window, documents, whole, counts=None):
    """(part, mask) of each part of this rank's work that some query sees."""
    for block in _allgather_blocks(rank, cp, q.shape[2] // 2, window):
        yield from visible_parts(block, window, q.device, documents, whole, counts)


def allgather_forward(q, k, v, group, documents=None, whole=None, window: int = 0,
                      counts=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output fp32, LSE fp32 (b, h, L)) of this rank's queries against the whole sequence;
    `documents` (b, L) this rank's document ids, `whole` the sequence's (`sequence_documents`)."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    scale = q.shape[-1] ** -0.5
    kv, d = _gather_kv(k, v, group), k.shape[-1]
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    for part, mask in _visible_blocks(rank, cp, q, window, documents, whole, counts):
        block_out, block_lse = part_forward(q, kv[..., :d], kv[..., d:], part, scale, mask)
        merge_rows(out, lse, part.rows, block_out, block_lse)
    return out, lse


def allgather_backward(dout, q, k, v, out, lse, group, documents=None, whole=None, window: int = 0):
    """(dq, dk, dv) of this rank's q, k, v, given the final output and LSE of its queries."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    scale = q.shape[-1] ** -0.5
    kv, d = _gather_kv(k, v, group), k.shape[-1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    for part, mask in _visible_blocks(rank, cp, q, window, documents, whole):
        dq_block, dk_block, dv_block = part_backward(dout, q, kv[..., :d], kv[..., d:], out, lse, part, scale, mask)
        dq[:, :, part.rows] += dq_block
        dkv[..., part.cols, :d] += dk_block
        dkv[..., part.cols, d:] += dv_block
    mine = _scatter_kv_grads(dkv, group)
    return dq.to(q.dtype), mine[..., :d].to(k.dtype), mine[..., d:].to(v.dtype)


ALLGATHER = BlockMethod(sequence_documents, allgather_forward, allgather_backward)


def allgather_attention(q, k, v, group, documents=None, window: int = 0, sinks=None, counts=None) -> torch.Tensor:
    """`documents` (b, L): this rank's tokens' document ids, to keep attention inside documents;
    `window`, `sinks` and `counts` as in ring.py's ring_attention."""
    return BlockwiseAttention.apply(q, k, v, sinks, ALLGATHER, group, documents, window, counts)


# ---- Ulysses -------------------------------------------------------------------------------------

def _sequence_to_heads(x, group):
    """(b, cp·n, L, d) split by sequence -> (b, n, cp·L, d) split by heads (rank slots in order)."""
    cp = dist.get_world_size(group)
    send = x.unflatten(1, (cp, -1)).movedim(1, 0).contiguous()  # head group r goes to rank r
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # slot r: rank r's tokens, my heads
    return received.movedim(0, 2).flatten(2, 3)


def _heads_to_sequence(x, group):
    """The inverse of `_sequence_to_heads`."""
    cp = dist.get_world_size(group)
    send = x.unflatten(2, (cp, -1)).movedim(2, 0).contiguous()  # rank r's tokens go back to rank r
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # slot r: my tokens, rank r's heads
    return received.movedim(0, 1).flatten(1, 2)


class SequenceToHeads(torch.autograd.Function):
    """The all-to-all; its gradient is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad.contiguous(), ctx.group), None


class HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad.contiguous(), ctx.group), None


def ulysses_attention(q, k, v, group, documents=None, window: int = 0, sinks=None, counts=None) -> torch.Tensor:
    """Every rank attends the whole sequence with cp-th of the heads: the window and the sinks
    (of its heads) go to the model's own masked attention; `counts` is unused (no blocks)."""
    cp = dist.get_world_size(group)
    kv_heads, local_len = k.shape[1], q.shape[2]
    # Each rank gets heads/cp query heads and must get the kv heads they use: with fewer kv heads
    # than cp, repeat each just enough (lcm(kv_heads, cp) divides heads, which cp divides).
    repeat = math.lcm(kv_heads, cp) // kv_heads
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    # One all-to-all for q, k and v: per destination rank, its query heads then its k and v heads
    # (v apart when its head dim differs from q's and k's, as in Multi-head Latent Attention).
    together = (q, k, v) if v.shape[-1] == q.shape[-1] else (q, k)
    parts = [t.unflatten(1, (cp, -1)) for t in together]
    sizes = [p.shape[2] for p in parts]
    mixed = SequenceToHeads.apply(torch.cat(parts, dim=2).flatten(1, 2), group)
    if len(together) == 3:
        q, k, v = mixed.split(sizes, dim=1)
    else:
        (q, k), v = mixed.split(sizes, dim=1), SequenceToHeads.apply(v.contiguous(), group)
    # Slots hold rank 0's tokens, then rank 1's...; attention needs them in sequence order.
    slot_positions = torch.cat([local_positions(r, cp, local_len, q.device) for r in range(cp)])
    in_order = slot_positions.argsort()
    q, k, v = (t.index_select(2, in_order) for t in (q, k, v))
    whole = None if documents is None else sequence_documents(documents, group)
    if window or sinks is not None:  # this rank's query heads are head group `rank` of the sinks
        mine = None if sinks is None else sinks.unflatten(0, (cp, -1))[dist.get_rank(group)]
        out = masked_attention(q, k, v, window, whole, mine)
    elif documents is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    else:  # every rank holds the whole sequence (for its heads): the whole sequence's mask
        out = document_attention(q, k, v, whole)
    out = out.index_select(2, slot_positions)  # back to slot order
    return HeadsToSequence.apply(out.contiguous(), group)
