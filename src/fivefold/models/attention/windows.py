"""How a sliding window, document masks and attention sinks cut attention over blocks
(models/attention/blocks.py) into parts a fast kernel can run: which rows of a block see which
columns, the tiles a window's edges leave, and the sinks folded into the merged log-sum-exp.
Parallelism-free: the single-device masked attention and context parallelism both use it."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace

import torch

from fivefold.models.attention.blocks import block_backward, block_forward, document_block

@dataclass(frozen=True)
class Block:
    """Query rows `rows` (local) against key columns `cols` (of the K/V tensor read); `causal`:
    a square block over the same positions. q_start/k_start: global positions of the first row and
    column (used only with a window). `mirrored`: a square block whose row a sees columns a and
    after, the causal mask mirrored (a window's far edge; computed by the causal kernel on
    reversed rows and columns)."""

    rows: slice
    cols: slice
    causal: bool
    q_start: int = 0
    k_start: int = 0
    mirrored: bool = False


def _length(s: slice) -> int:
    return s.stop - s.start


def trim_to_window(block: Block, window: int, device=None) -> tuple[Block | None, torch.Tensor | None]:
    """(the block cut to what the window shows, or None when it shows nothing; the (1, rows, cols)
    bool mask of window-visible pairs, or None when the block's causal flag says it all)."""
    n_rows, n_cols = _length(block.rows), _length(block.cols)
    if block.causal:  # the diagonal is always seen; nothing to trim
        if window >= n_rows:
            return block, None
        i = torch.arange(n_rows, device=device)[:, None]
        j = torch.arange(n_cols, device=device)[None, :]
        return block, ((j <= i) & (i - j < window))[None]
    # Keys before every query: row i sees column j when i_pos - j_pos < window.
    first_col = max(block.k_start, block.q_start - window + 1)  # the earliest key any row sees
    end_row = min(block.q_start + n_rows, block.k_start + n_cols + window - 1)  # rows past it see none
    if first_col >= block.k_start + n_cols or end_row <= block.q_start:
        return None, None
    trimmed = replace(block, rows=slice(block.rows.start, block.rows.start + end_row - block.q_start),
                      cols=slice(block.cols.start + first_col - block.k_start, block.cols.stop),
                      k_start=first_col)
    if _length(trimmed.rows) - 1 + trimmed.q_start - first_col < window:  # the farthest pair
        return trimmed, None
    rows_pos = trimmed.q_start + torch.arange(_length(trimmed.rows), device=device)
    cols_pos = first_col + torch.arange(_length(trimmed.cols), device=device)
    return trimmed, (rows_pos[:, None] - cols_pos[None, :] < window)[None]


# Tiles narrower than this make more kernel calls than the masked path costs.
MIN_TILE = 16


def window_tiles(block: Block, window: int) -> list[Block] | None:
    """A chunk-pair block cut into tiles of t = gcd(window, chunk) that each need no mask, or None
    when t is too small to pay. With window = m·t, the query tile at position p sees the key tile at
    p causally, the tiles at p−t … p−(m−1)·t whole (one call), and of the tile at p−m·t every key
    after its row (a mirrored block: key j of row i when j > i); no other tile."""
    chunk = _length(block.rows)
    t = math.gcd(window, chunk)
    if _length(block.cols) != chunk or (t < MIN_TILE and t not in (window, chunk)):
        return None
    m, first, end = window // t, block.k_start, block.k_start + chunk

    def cols(start, stop):  # key positions -> columns of the K/V tensor
        return slice(block.cols.start + start - first, block.cols.start + stop - first)

    tiles = []
    for row in range(0, chunk, t):
        p, rows = block.q_start + row, slice(block.rows.start + row, block.rows.start + row + t)
        if first <= p < end:
            tiles.append(Block(rows, cols(p, p + t), True, p, p))
        full_start, full_stop = max(first, p - (m - 1) * t), min(end, p)
        if full_start < full_stop:
            tiles.append(Block(rows, cols(full_start, full_stop), False, p, full_start))
        far = p - m * t
        if first <= far < end and t > 1:
            tiles.append(Block(slice(rows.start, rows.stop - 1), cols(far + 1, far + t), False, p, far + 1,
                               mirrored=True))
    return tiles


def visible_parts(block: Block, window: int, device, q_documents=None, k_documents=None,
                  counts: Counter | None = None, tiles: bool = True) -> list[tuple[Block, torch.Tensor | None]]:
    """The parts of `block` to compute, each with its (b or 1, rows, cols) mask or None, under the
    window (0: none) and document masking (`q_documents` (b, L) of the local rows, `k_documents`
    (b, Lk) of the key tensor's columns, or None); [] when no query sees a key of the block.
    `counts` tallies the blocks computed and skipped (a block computed in tiles counts once).
    `tiles=False`: a block the window crosses stays one masked part (for a kernel that takes masks)."""
    window_mask, whole = None, block
    if window:
        block, window_mask = trim_to_window(block, window, device)
        if block is None:
            _count(counts, "outside_window")
            return []
    mask = window_mask
    if q_documents is not None:
        visible, document_mask = document_block(q_documents[:, block.rows], k_documents[:, block.cols], block.causal)
        if visible and document_mask is not None:
            mask = document_mask if window_mask is None else document_mask & window_mask
            visible = bool(mask.any())
        if not visible:
            _count(counts, "outside_documents")
            return []
    _count(counts, "computed")
    if window_mask is not None and q_documents is None and tiles:
        cut = window_tiles(whole, window)
        if cut is not None:
            return [(tile, None) for tile in cut]
    return [(block, mask)]


def part_forward(q, k, v, block: Block, scale: float, mask, mask_kernel: bool = False):
    """block_forward of the block's rows of q against its columns of k and v."""
    q, k, v = q[:, :, block.rows], k[..., block.cols, :], v[..., block.cols, :]
    if not block.mirrored:
        return block_forward(q, k, v, block.causal, scale, mask, mask_kernel)
    out, lse = block_forward(q.flip(2), k.flip(2), v.flip(2), True, scale)
    return out.flip(2), lse.flip(-1)


def part_backward(dout, q, k, v, out, lse, block: Block, scale: float, mask, mask_kernel: bool = False):
    """block_backward of the block's rows and columns: (dq of its rows, dk and dv of its columns)."""
    rows, cols = block.rows, block.cols
    dout, q, out, lse = dout[:, :, rows], q[:, :, rows], out[:, :, rows], lse[:, :, rows]
    k, v = k[..., cols, :], v[..., cols, :]
    if not block.mirrored:
        return block_backward(dout, q, k, v, out, lse, block.causal, scale, mask, mask_kernel)
    grads = block_backward(dout.flip(2), q.flip(2), k.flip(2), v.flip(2), out.flip(2), lse.flip(-1), True, scale)
    return tuple(g.flip(2) for g in grads)


def _count(counts: Counter | None, what: str) -> None:
    if counts is not None:
        counts[what] += 1


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold the heads' sink logits (h,) into merged fp32 attention: (out, LSE) -> (out', LSE')."""
    with_sinks = torch.logaddexp(lse, sinks.float()[None, :, None])
    return out * torch.exp(lse - with_sinks).unsqueeze(-1), with_sinks


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The gradient of the sink logits (h,) from this rank's rows, given the final out and LSE."""
    row_dot = (dout.float() * out.float()).sum(-1)  # (b, h, L)
    sink_share = torch.exp(sinks.float()[None, :, None] - lse)
    return -(sink_share * row_dot).sum((0, 2)).to(sinks.dtype)
