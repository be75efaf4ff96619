"""Causal attention with what SDPA's causal flag cannot say: a sliding window (a query sees at most
`window` keys, itself included), attention sinks (one learned logit per head that joins every
query's softmax denominator, as a key whose value is zero) and document masks (models/documents.py).

Without sinks, the window and the documents make one boolean mask for PyTorch's attention (any
device's kernel that takes a mask). With sinks the scores are computed plainly, in fp32: each
row's logits get the head's sink as one more column, the softmax normalises them together, and the
sink's column is dropped before the values are weighted (transformers' eager gpt-oss attention
computes the same). That path materialises the (heads, seq, seq) scores; a fused kernel for it is
later work, and the planner counts it unfused (plan/hardware.py `fuses_attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def allowed_keys(seq: int, device, window: int = 0, documents: torch.Tensor | None = None) -> torch.Tensor:
    """(batch or 1, 1, seq, seq) bool, True where query i may see key j: j <= i, i - j < window
    (window 0: any distance), and both in one document when `documents` (batch, seq) is given."""
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    allowed = j <= i
    if window:
        allowed = allowed & (i - j < window)
    allowed = allowed[None, None]
    if documents is not None:
        allowed = allowed & (documents[:, :, None] == documents[:, None, :])[:, None]
    return allowed


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
                     documents: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over (batch, heads, seq, head_dim); k/v may have fewer heads (GQA), v another head
    dim. `sinks` (heads,): the heads' sink logits, or None."""
    mask = allowed_keys(q.shape[2], q.device, window, documents)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return sink_attention(q, k, v, mask, sinks)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   sinks: torch.Tensor) -> torch.Tensor:
    """softmax([q kᵀ/sqrt(d), sink]) without the sink's column, times v; fp32 inside. The query heads
    of a kv head are one broadcast dimension, so k and v are never copied per query head."""
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
