"""Each attention head's largest logit q·k/√d over the (query, key) pairs it may attend: what
QK-clip (train.qk_clip, Kimi K2's MuonClip) bounds. Plain tensors, no parallelism: a context-parallel
core passes its queries' and the gathered keys' positions (parallel/context/apply.py).

The attention kernels (SDPA, the blockwise and ring ones) never hand back their scores, so the
maxima are computed again here, in tiles of queries (memory CHUNK·keys per head, not seq²), without
gradients: one more q·kᵀ per layer and micro-batch when QK-clip is on."""

from __future__ import annotations

import torch

CHUNK = 256  # queries per tile


def head_logit_max(q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor,
                   window: int = 0, q_documents: torch.Tensor | None = None,
                   k_documents: torch.Tensor | None = None) -> torch.Tensor:
    """(heads,) fp32: max over the batch and the allowed pairs of q·k/√d. q (b, heads, Lq, d), k
    (b, kv_heads, Lk, d) (grouped queries share a key head); positions (Lq,), (Lk,) in the whole
    sequence; a query sees keys at or before it, fewer than `window` back (0: all), in its document
    when documents (b, Lq), (b, Lk) are given."""
    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    q = q.detach().float().unflatten(1, (kv_heads, heads // kv_heads))  # (b, hkv, group, Lq, d)
    k = k.detach().float()[:, :, None]  # (b, hkv, 1, Lk, d)
    best = torch.full((heads,), float("-inf"), device=q.device)
    for start in range(0, q.shape[3], CHUNK):
        rows = slice(start, start + CHUNK)
        scores = q[:, :, :, rows] @ k.transpose(-1, -2) * dim ** -0.5  # (b, hkv, group, tile, Lk)
        allowed = k_positions[None, :] <= q_positions[rows, None]
        if window:
            allowed = allowed & (q_positions[rows, None] - k_positions[None, :] < window)
        allowed = allowed[None, None, None]
        if q_documents is not None:
            allowed = allowed & (q_documents[:, rows, None] == k_documents[:, None, :])[:, None, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 3, 4)).flatten())
    return best
