"""The language-model loss of one micro-batch, and how loss masks keep it the global batch's mean.

Plain text trains every position, and every micro-batch of every rank holds as many, so the mean of
the micro-batch means (gradient accumulation divides by their number, data parallelism averages
over its ranks) is the mean over the global batch. Chat data (`fivefold prepare --chat`) trains only
the replies: micro-batches hold different numbers of trained tokens, and a mean of means would weigh
a token of a short reply more than one of a long reply, differently in every layout. So with a loss
mask each micro-batch's loss is the *sum* over its trained positions times one factor for the whole
step, (micro-batches · ranks the mean is later taken over) / (trained positions of the global
batch): the same averaging then yields the global batch's mean over its trained tokens, in every
layout, with the gradient arithmetic of plain text.

Both are computed chunk by chunk over the tokens (models/cross_entropy.py): no fp32 copy, log-softmax
or gradient of the whole micro-batch's logits is ever held, and the gradient is written into the
logits' own storage (the training step's model output, read by nothing else). Under tensor
parallelism the logits are a DTensor sharded on the vocabulary (parallel/tensor/layers.py
VocabParallelOutput): each tp rank computes on its own columns and the per-token log-sum-exp and
target logit are combined over the tp group (one max and one sum of a few floats per token), the
vocabulary-parallel cross-entropy, without gathering the logits. Any other layout of logits falls
back to F.cross_entropy (under `loss_parallel` where the caller set it).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from fivefold.models.cross_entropy import IGNORE, chunked_cross_entropy
from fivefold.torch_internals import c10d_functional as _c10d

__all__ = ["IGNORE", "LMLoss", "cross_entropy", "lm_loss", "trained_positions"]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean",
                  overwrite: bool = False) -> torch.Tensor:
    """F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction) over the flattened
    tokens, chunked (models/cross_entropy.py), vocabulary-parallel on logits sharded over the
    vocabulary. `overwrite`: the logits may take their gradient in place (module doc)."""
    if isinstance(logits, DTensor):
        shard = VocabShard.of(logits)
        if shard is None:  # not a 1-D vocabulary split: the DTensor's own cross-entropy
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE,
                                   reduction=reduction)
        return chunked_cross_entropy(logits.to_local(), labels, reduction, overwrite=overwrite, shard=shard)
    return chunked_cross_entropy(logits, labels, reduction, overwrite=overwrite)


class VocabShard:
    """This rank's columns of logits split evenly over the vocabulary on a 1-D mesh (the tp group),
    and the reductions over that group the chunked cross-entropy needs."""

    def __init__(self, first: int, group_name: str):
        self.first, self.group_name = first, group_name

    @staticmethod
    def of(logits: DTensor) -> "VocabShard | None":
        mesh, placements = logits.device_mesh, logits.placements
        if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], Shard):
            return None
        if placements[0].dim % logits.ndim != logits.ndim - 1 or logits.shape[-1] % mesh.size():
            return None
        local = logits.shape[-1] // mesh.size()
        return VocabShard(mesh.get_local_rank() * local, mesh.get_group().group_name)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return _c10d.wait_tensor(_c10d.all_reduce(t.contiguous(), "max", self.group_name))

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return _c10d.wait_tensor(_c10d.all_reduce(t.contiguous(), "sum", self.group_name))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
    """Mean next-token cross-entropy over every position (fp32 for a stable log-softmax). Labels
    (batch, seq, 1 + mtp_depth) carry multi-token prediction's targets too (models/mtp.py): the
    LM labels are their first column."""
    if labels.dim() == 3:
        labels = labels[..., 0]
    return cross_entropy(logits, labels, overwrite=overwrite)


class LMLoss:
    """`lm_loss`, or under a loss mask the scaled sum over trained positions. One object, given to
    the pipeline schedule too (which calls it with logits and labels only), so both paths read the
    same factor: Parallelized states it around each step's forwards with `scaled_by` (None = plain
    text), and outside that block it is None.

    `overwrite`: the logits it is given are a step's model output that nothing reads after the loss,
    so their storage takes their gradient (parallel/loss.py module doc); Parallelized and the
    pipeline's last stage hand it exactly that."""

    def __init__(self, overwrite: bool = True):
        self.scale: float | None = None
        self.overwrite = overwrite

    @contextlib.contextmanager
    def scaled_by(self, scale: float | None):
        self.scale = scale
        try:
            yield
        finally:
            self.scale = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return lm_loss(logits, labels, self.overwrite)
        if labels.dim() == 3:
            labels = labels[..., 0]
        return cross_entropy(logits, labels, "sum", self.overwrite) * self.scale


def trained_positions(windows) -> int | None:
    """Trained label positions in these windows (whole sequences, before cp splits them), or None
    when they carry no loss mask (context.DocumentWindows.loss_mask)."""
    mask = getattr(windows, "loss_mask", None)
    return None if mask is None else int(mask[:, 1:].sum())
