"""Attention a block at a time: one block of queries against one block of keys, with its
log-sum-exp (LSE), the exact merge of blocks, and how a sliding window and document masks cut a
block into parts a fast kernel can run. Parallelism-free: the single-device masked attention
(models/attention/masked.py) and context parallelism (parallel/context/) both attend through it.

Blocks. Attention computed a block at a time (a query block against a key/value block) merges the
blocks exactly with the online-softmax rule. That needs, per block, the output and the LSE of each
query row; the backward of a block needs the *final* (merged) output and LSE, which turn the block's
scores into the true global probabilities.

Shapes: q (batch, heads, Lq, head_dim); k, v (batch, kv_heads, Lk, head_dim) with kv_heads dividing
heads (grouped-query attention). `causal` blocks are square (Lq == Lk, the same token positions):
query i sees keys 0..i. Other blocks are fully visible. Outputs and LSE are fp32 (accumulators).

Document masking (`data.document_mask`) adds a `mask` (batch, Lq, Lk), True where a query may see a
key: `document_block` derives it from the document ids of the block's rows and columns, says when
no pair is visible (the caller skips the block) and drops the mask when it hides nothing the block
does not hide already (the fast kernels then run). A row that sees no key of a block gets LSE −inf
and output 0, which the merge folds in as nothing.

Three implementations: PyTorch's fused kernels, which return the LSE themselves and take the
global output/LSE in their backward — memory-efficient attention on CUDA, flash attention on CPU
(computed in fp32 there, like the plain path; where the caller asks, `mask_kernel`, it takes a
block's mask too, as an additive one) — and plain PyTorch for any other device and masked blocks (matmul + logsumexp, tiled
over query rows so the score matrix stays small).

Windows. With a sliding window (query at position i sees keys i-window+1 .. i) a block is
  - outside the window when its nearest pair is `window` or more apart: skipped, never computed;
  - cut into tiles that need no mask when the window and the block share a divisor t of 16 or more
    (`window_tiles`: each query tile sees one tile causally, some whole, and one mirrored, the
    causal mask reversed, which the causal kernel computes on reversed rows and columns), so the
    fused kernels run on all of it;
  - else trimmed to the rows that see some key and the columns some row sees, then masked where
    the window crosses it (a boolean mask: the plain PyTorch block path);
  - left whole when every pair is inside the window.
With document masking the mask path serves every block the window crosses. Blocks are `Block`s
with the global positions of their first row and column, so one rule serves every caller.

Sinks. A sink is one logit per head that joins every query's softmax denominator as a key whose
value is zero. It must join the log-sum-exp merge exactly once, not once per block: the blocks are
merged without it, then `add_sinks` folds it in, LSE ← logaddexp(LSE, sink) and the output scaled
by exp(LSE_before − LSE_after). The backward of each block is then the ordinary one given that
final output and LSE (the probabilities exp(score − LSE) are the true ones), and the sink's own
gradient is −Σ_rows P_sink · rowsum(dO ∘ O) (`sink_grad`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fivefold.torch_internals import aten_op, has_aten_op


# The plain path builds score matrices a tile of query rows at a time, about this many elements
# each (4 MiB in fp32): bounds its transient memory and keeps the tile in cache.
TILE_ELEMENTS = 1 << 20


def use_fused_kernel(q: torch.Tensor) -> bool:
    return q.device.type == "cuda"


def use_cpu_flash_kernel(q: torch.Tensor, v: torch.Tensor) -> bool:
    # The CPU flash kernel needs V's head dim equal to Q's (Multi-head Latent Attention's is not).
    return (q.device.type == "cpu" and q.shape[-1] == v.shape[-1]
            and has_aten_op("_scaled_dot_product_flash_attention_for_cpu"))


def document_block(q_documents: torch.Tensor, k_documents: torch.Tensor, causal: bool):
    """(visible, mask) of a block from the document ids of its query rows (b, Lq) and key columns
    (b, Lk): visible is False when no query may see any key; mask is None when every pair the block
    shows is inside one document, else the (b, Lq, Lk) bool mask of allowed pairs."""
    same = q_documents[:, :, None] == k_documents[:, None, :]
    if causal:
        shown = torch.ones(same.shape[1:], dtype=torch.bool, device=same.device).tril()
        allowed, hides_nothing = same & shown, bool((same | ~shown).all())
    else:
        allowed, hides_nothing = same, bool(same.all())
    if hides_nothing:
        return True, None
    return bool(allowed.any()), allowed


def block_forward(q, k, v, causal: bool, scale: float, mask=None,
                  mask_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(output fp32 (b, h, Lq, d), LSE fp32 (b, h, Lq)) of softmax(q kᵀ·scale) v over this block;
    `mask` (b, Lq, Lk), when given, hides the pairs where it is False: plain PyTorch, or with
    `mask_kernel` CPU's flash kernel taking it as an additive mask (faster; other rounding)."""
    if mask is not None:
        if mask_kernel and use_cpu_flash_kernel(q, v):
            return _cpu_flash_forward(q, k, v, causal, scale, mask)
        return _math_forward(q, k, v, causal, scale, mask)
    if use_fused_kernel(q):
        return _fused_forward(q, k, v, causal, scale)
    if use_cpu_flash_kernel(q, v):
        return _cpu_flash_forward(q, k, v, causal, scale)
    return _math_forward(q, k, v, causal, scale)


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, mask=None, mask_kernel: bool = False):
    """(dq, dk, dv) in fp32 of this block's share of attention, given the final out and LSE of
    these query rows (so probabilities are exp(score - LSE), already normalised over every block)."""
    if mask is not None:
        if mask_kernel and use_cpu_flash_kernel(q, v):
            return _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale, mask)
        return _math_backward(dout, q, k, v, out, lse, causal, scale, mask)
    if use_fused_kernel(q):
        return _fused_backward(dout, q, k, v, out, lse, causal, scale)
    if use_cpu_flash_kernel(q, v):
        return _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale)
    return _math_backward(dout, q, k, v, out, lse, causal, scale)


def merge_rows(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out, block_lse) -> None:
    """Fold a block's partial result into the running (out, LSE) of query rows `rows`, in place:
    each side is weighted by its share exp(lse_side - lse_total) of the combined softmax mass. A
    row with no visible key on either side (LSE −inf) keeps weight 0 instead of exp(−inf + inf)."""
    old_lse = lse[:, :, rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    finite = new_lse.nan_to_num(neginf=0.0).unsqueeze(-1)
    out[:, :, rows] = (out[:, :, rows] * torch.exp(old_lse.unsqueeze(-1) - finite)
                       + block_out * torch.exp(block_lse.unsqueeze(-1) - finite))
    lse[:, :, rows] = new_lse


# ---- plain PyTorch -------------------------------------------------------------------------------

def _grouped(q, k, v):
    """q as (b, kv_heads, group, L, d) and k, v as (b, kv_heads, 1, L, d): matmuls broadcast the
    kv heads over their query group instead of copying them."""
    b, h, lq, d = q.shape
    kv_heads = k.shape[1]
    return (q.float().reshape(b, kv_heads, h // kv_heads, lq, d),
            k.float().unsqueeze(2), v.float().unsqueeze(2))


def _row_tiles(q_grouped, keys: int):
    """(start, stop) of query-row tiles whose score matrices hold about TILE_ELEMENTS elements."""
    rows = q_grouped.shape[-2]
    per_row = q_grouped[..., 0, 0].numel() * keys
    step = max(1, min(rows, TILE_ELEMENTS // max(per_row, 1)))
    return [(start, min(rows, start + step)) for start in range(0, rows, step)]


def _tile_scores(q_tile, k, start: int, stop: int, causal: bool, scale: float, mask=None):
    """Scores of query rows start..stop; for a causal block only keys 0..stop-1 can be visible;
    `mask` (b, Lq, Lk) hides the pairs where it is False."""
    key_stop = stop if causal else k.shape[-2]
    # Never modify a matmul's output in place: selective recomputation may keep that very tensor.
    scores = torch.matmul(q_tile, k[..., :key_stop, :].transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(start, stop, device=q_tile.device)
        hidden = torch.arange(key_stop, device=q_tile.device)[None, :] > rows[:, None]
        scores.masked_fill_(hidden, float("-inf"))
    if mask is not None:  # (b, 1, 1, rows, keys) against scores (b, kv_heads, group, rows, keys)
        scores.masked_fill_(~mask[:, None, None, start:stop, :key_stop], float("-inf"))
    return scores, key_stop


def _math_forward(q, k, v, causal, scale, mask=None):
    qg, kg, vg = _grouped(q, k, v)
    out = torch.empty(qg.shape[:-1] + (v.shape[-1],), dtype=torch.float32, device=q.device)
    lse = torch.empty(qg.shape[:-1], dtype=torch.float32, device=q.device)
    for start, stop in _row_tiles(qg, k.shape[2]):
        scores, key_stop = _tile_scores(qg[..., start:stop, :], kg, start, stop, causal, scale, mask)
        tile_lse = torch.logsumexp(scores, dim=-1)
        # A row that sees no key (document masking) has LSE −inf: subtract 0 there, so its
        # probabilities are exp(−inf) = 0 rather than NaN.
        probs = scores.sub_(tile_lse.nan_to_num(neginf=0.0).unsqueeze(-1)).exp_()  # in place
        out[..., start:stop, :] = probs @ vg[..., :key_stop, :]
        lse[..., start:stop] = tile_lse
    return out.flatten(1, 2), lse.flatten(1, 2)


def _math_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    qg, kg, vg = _grouped(q, k, v)
    shape = qg.shape
    out_shape = shape[:-1] + (v.shape[-1],)  # V's head dim may differ from Q's
    dout_g, out_g = dout.float().reshape(out_shape), out.float().reshape(out_shape)
    lse_g = lse.reshape(shape[:-1])
    dq = torch.empty(shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(kg.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(vg.shape, dtype=torch.float32, device=q.device)
    for start, stop in _row_tiles(qg, k.shape[2]):
        rows = slice(start, stop)
        scores, key_stop = _tile_scores(qg[..., rows, :], kg, start, stop, causal, scale, mask)
        probs = scores.sub_(lse_g[..., rows].unsqueeze(-1)).exp_()
        d_tile = dout_g[..., rows, :]
        # The query group's contributions to a shared kv head add up (sum over dim 2).
        dv[..., :key_stop, :] += (probs.transpose(-1, -2) @ d_tile).sum(2, keepdim=True)
        # softmax backward: dS = P ∘ (dP − rowsum(dO ∘ O)), with O the final output of the row.
        row_dot = (d_tile * out_g[..., rows, :]).sum(-1, keepdim=True)
        d_scores = (d_tile @ vg[..., :key_stop, :].transpose(-1, -2) - row_dot).mul_(probs).mul_(scale)
        dq[..., rows, :] = d_scores @ kg[..., :key_stop, :]
        dk[..., :key_stop, :] += (d_scores.transpose(-1, -2) @ qg[..., rows, :]).sum(2, keepdim=True)
    return dq.flatten(1, 2), dk.squeeze(2), dv.squeeze(2)


# ---- CUDA: PyTorch's fused memory-efficient attention ---------------------------------------------
# Untested on CPU-only CI except for its call signatures (meta tensors, tests/test_context_ops.py).

_LSE_ALIGN = 32  # the kernel pads its LSE rows to a multiple of 32


def _expand_kv(k, v, heads):
    """The fused kernels want as many kv heads as query heads; expand locally (not on the wire)."""
    group = heads // k.shape[1]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def _fused_forward(q, k, v, causal, scale):
    k, v = _expand_kv(k, v, q.shape[1])
    out, lse, _, _ = aten_op("_scaled_dot_product_efficient_attention")(
        q, k, v, None, True, 0.0, causal, scale=scale)
    # Copies: callers merge into these in place, and selective recomputation may keep the kernel's own.
    return out.to(torch.float32, copy=True), lse[..., :q.shape[2]].to(torch.float32, copy=True)


def _fused_backward(dout, q, k, v, out, lse, causal, scale):
    kv_heads = k.shape[1]
    k, v = _expand_kv(k, v, q.shape[1])
    lse = F.pad(lse.float(), (0, -lse.shape[-1] % _LSE_ALIGN)).contiguous()
    no_dropout = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed/offset: unused
    dq, dk, dv, _ = aten_op("_scaled_dot_product_efficient_attention_backward")(
        dout.to(q.dtype), q, k, v, None, out.to(q.dtype), lse, no_dropout, no_dropout, 0.0,
        [True, True, True, False], causal, scale=scale)
    group = q.shape[1] // kv_heads
    dk = dk.float().unflatten(1, (kv_heads, group)).sum(2)
    dv = dv.float().unflatten(1, (kv_heads, group)).sum(2)
    return dq.float(), dk, dv


# ---- CPU: PyTorch's flash attention kernel, in fp32 -------------------------------------------------
# About 3x less CPU time than the plain path per block, and no score tiles for selective
# recomputation to keep (benchmarks/RESULTS.md, parallel scaling).

def _kv_sum(grad, kv_heads: int):
    """Gradients of expanded kv heads back to the shared heads (the query group's sum)."""
    return grad.unflatten(1, (kv_heads, grad.shape[1] // kv_heads)).sum(2)


def _additive(mask, causal: bool):
    """A (b, Lq, Lk) bool mask as the kernel's additive (b, 1, Lq, Lk) fp32 one (0 or −inf), the
    causal triangle folded in (the kernel is called without its causal flag then)."""
    if causal:
        mask = mask & torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask, bias.unsqueeze(1)


def _cpu_flash_forward(q, k, v, causal, scale, mask=None):
    k, v = _expand_kv(k.float(), v.float(), q.shape[1])
    bias = None
    if mask is not None:
        mask, bias = _additive(mask, causal)
        causal = False
    out, lse = aten_op("_scaled_dot_product_flash_attention_for_cpu")(
        q.float(), k, v, 0.0, causal, attn_mask=bias, scale=scale)
    # Copies: callers merge into these in place, and selective recomputation may keep the kernel's own.
    out, lse = out.clone(memory_format=torch.contiguous_format), lse.clone()
    if mask is not None:  # the kernel gives a row that sees no key output 0 but LSE 0: make it −inf
        lse.masked_fill_(~mask.any(-1).unsqueeze(1), float("-inf"))
    return out, lse


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    kv_heads = k.shape[1]
    k, v = _expand_kv(k.float(), v.float(), q.shape[1])
    bias = None
    if mask is not None:
        bias, causal = _additive(mask, causal)[1], False
    dq, dk, dv = aten_op("_scaled_dot_product_flash_attention_for_cpu_backward")(
        dout.float(), q.float(), k, v, out.float(), lse.float(), 0.0, causal, attn_mask=bias, scale=scale)
    return dq, _kv_sum(dk, kv_heads), _kv_sum(dv, kv_heads)
