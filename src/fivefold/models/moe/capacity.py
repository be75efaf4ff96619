"""MoE capacity: which (token, expert) assignments each expert takes per sequence, also when the
sequence is split over ranks (context parallelism's pieces, tensor parallelism's slices, or both):
the decisions models/moe/layer.py's MoE takes, with the split it is given (see its docstring)."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


def capacity_keep(indices: torch.Tensor, n_experts: int, capacity: int | None, pieces=None) -> torch.Tensor:
    """(batch, seq, k) chosen experts -> (batch, seq, k) bool, False for assignments dropped.

    Per sequence, each expert takes at most `capacity` assignments, first-choice assignments
    before second choices (GShard), earlier positions first within a choice.

    `pieces` (a SequenceSplit), when given, says the `seq` positions are pieces of longer sequences
    whose other pieces other ranks hold, and the decision is the one taken on the whole sequences;
    None: these are whole sequences."""
    if capacity is None:
        return torch.ones_like(indices, dtype=torch.bool)
    if pieces is not None:
        return _pieces_keep(indices, n_experts, capacity, pieces)
    batch, seq, k = indices.shape
    by_priority = indices.transpose(1, 2).reshape(batch, k * seq)  # slot-major, then position
    # Rank of each assignment among its expert's; (batch, k*seq, E) is small for a sequence.
    one_hot = F.one_hot(by_priority, n_experts)
    rank = (one_hot.cumsum(1) * one_hot).sum(-1) - 1
    return (rank < capacity).view(batch, k, seq).transpose(1, 2)


class SequenceSplit(Protocol):
    """How a layout splits sequences, as the MoE decisions need it (parallel/context/apply.py
    SequencePieces: over cp ranks; parallel/tensor/apply.py SequenceSlices: a rank's sequence into
    tp slices). This module's positions are the chunks `chunks` (indices, laid end to end) of a
    whole made of `n_chunks` equal chunks."""

    chunks: list[int]
    n_chunks: int

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """(len(chunks), ...) per-chunk counts from every holder -> (n_chunks, ...) by chunk (no autograd)."""

    def total(self, t: torch.Tensor) -> torch.Tensor:
        """A per-sequence statistic summed over every holder of a chunk (differentiable)."""


def nested(outer: SequenceSplit | None, inner: SequenceSplit | None) -> SequenceSplit | None:
    """The split of whole sequences that this module's tokens are, when they are `inner`'s slices
    of the rank's sequence, itself `outer`'s pieces of the whole sequence (either None: that level
    does not split)."""
    if inner is None or outer is None:
        return inner or outer
    return NestedPieces(outer, inner)


class NestedPieces:
    """Pieces of pieces, a SequenceSplit. The rank's sequence is `outer`'s a chunks;
    `inner` cuts it into b equal slices, this module holding one. Cutting each outer chunk into b
    sub-chunks makes both levels whole numbers of sub-chunks: the rank's sequence is a·b of them,
    this slice a, and the whole sequence outer.n_chunks·b. (The sub-chunks must hold whole
    positions: the sequence length divisible by outer.n_chunks·b, which validate() checks.)"""

    def __init__(self, outer, inner):
        self.outer, self.inner = outer, inner
        a, b = len(outer.chunks), inner.n_chunks
        (t,) = inner.chunks  # one slice per module
        local = range(t * a, (t + 1) * a)  # sub-chunk indices in the rank's sequence
        self.chunks = [outer.chunks[j // b] * b + j % b for j in local]
        self.n_chunks = outer.n_chunks * b

    def total(self, t: torch.Tensor) -> torch.Tensor:
        """Over the slices of the rank's sequence, then over the ranks' pieces."""
        return self.outer.total(self.inner.total(t))

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """(a, ...) for this slice's sub-chunks -> (outer.n_chunks·b, ...) by global sub-chunk."""
        a, b = len(self.outer.chunks), self.inner.n_chunks
        rank_sequence = self.inner.gather(local.unsqueeze(0)).reshape(a * b, *local.shape[1:])
        per_outer_chunk = rank_sequence.view(a, b, *local.shape[1:])  # sub-chunks of each outer chunk
        return self.outer.gather(per_outer_chunk).reshape(self.n_chunks, *local.shape[1:])


def _pieces_keep(indices: torch.Tensor, n_experts: int, capacity: int, pieces) -> torch.Tensor:
    """capacity_keep's whole-sequence decision, taken on pieces of the sequences.

    The local `seq` positions are `len(pieces.chunks)` equal chunks laid end to end; chunk i is
    chunk `pieces.chunks[i]` of the whole sequence's `pieces.n_chunks`. `pieces.gather(t)` takes a
    (local chunks, ...) tensor from every holder and returns it (n_chunks, ...) by global chunk.
    In the whole sequence, an assignment's rank among its expert's (slot-major, then position) is
    (assignments of earlier slots, anywhere) + (same slot, earlier chunks) + (its rank inside its
    own chunk): only the per-chunk counts travel, a few integers per expert."""
    batch, seq, k = indices.shape
    n_local = len(pieces.chunks)
    one_hot = F.one_hot(indices.view(batch, n_local, seq // n_local, k), n_experts)  # (b, chunk, pos, k, E)
    counts = pieces.gather(one_hot.sum(2).transpose(0, 1).contiguous())  # (n_chunks, b, k, E)
    slot_totals = counts.sum(0)  # (b, k, E)
    earlier_slots = slot_totals.cumsum(1) - slot_totals
    earlier_chunks = (counts.cumsum(0) - counts)[pieces.chunks]  # (local chunks, b, k, E)
    offset = (earlier_slots + earlier_chunks).transpose(0, 1).unsqueeze(2)  # (b, chunk, 1, k, E)
    rank = ((one_hot.cumsum(2) - 1 + offset) * one_hot).sum(-1)
    return (rank < capacity).view(batch, seq, k)
