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

In training and evaluation the model makes no logits at all: given the labels, its output layer
returns the summed cross-entropy over the positions with a target, computed chunk by chunk from
the hidden states and its weight (models/loss/linear_cross_entropy.py; under tensor parallelism from
each rank's vocabulary columns, combined over the tp group with one max and one sum of a few floats
per token: Megatron's vocabulary-parallel cross-entropy). `LMLoss` turns that sum into the mean,
or scales it under a loss mask.

Logits a caller does hold (a model called without labels) go through the chunked cross-entropy
(models/loss/cross_entropy.py): no fp32 copy, log-softmax or gradient of the whole micro-batch's logits,
the gradient written into the logits' own storage where the caller allows it; DTensor logits
sharded on the vocabulary are reduced the same way over the tp group. Any other layout of logits
falls back to F.cross_entropy (under `loss_parallel` where the caller set it).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fivefold.models.loss.cross_entropy import IGNORE, chunked_cross_entropy
from fivefold.parallel.vocab_shard import VocabShard

__all__ = ["IGNORE", "LMLoss", "cross_entropy", "lm_loss", "trained_positions"]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean",
                  overwrite: bool = False) -> torch.Tensor:
    """F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction) over the flattened
    tokens, chunked (models/loss/cross_entropy.py), vocabulary-parallel on logits sharded over the
    vocabulary. `overwrite`: the logits may take their gradient in place (module doc)."""
    if isinstance(logits, DTensor):
        shard = VocabShard.of(logits)
        if shard is None:  # not a 1-D vocabulary split: the DTensor's own cross-entropy
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE,
                                   reduction=reduction)
        return chunked_cross_entropy(logits.to_local(), labels, reduction, overwrite=overwrite, shard=shard)
    return chunked_cross_entropy(logits, labels, reduction, overwrite=overwrite)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
    """Mean next-token cross-entropy over every position (fp32 for a stable log-softmax). Labels
    (batch, seq, 1 + mtp_depth) carry multi-token prediction's targets too (models/mtp.py): the
    LM labels are their first column."""
    if labels.dim() == 3:
        labels = labels[..., 0]
    return cross_entropy(logits, labels, overwrite=overwrite)


class LMLoss:
    """The micro-batch's loss from what the model returned: the summed cross-entropy of its fused
    output layer (a scalar) or logits; the mean over the positions with a target, or under a loss
    mask the sum times the step's factor. One object, given to the pipeline schedule too (which
    calls it with the last stage's output and the labels only), so both paths read the same factor:
    Parallelized states it around each step's forwards with `scaled_by` (None = plain text), and
    outside that block it is None.

    `overwrite`: logits it is given are a step's model output that nothing reads after the loss,
    so their storage takes their gradient (module doc)."""

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

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if labels.dim() == 3:  # multi-token prediction's targets: the LM labels are the first column
            labels = labels[..., 0]
        if output.dim() == 0:  # the summed cross-entropy of the fused output layer
            return output / (labels != IGNORE).sum() if self.scale is None else output * self.scale
        if self.scale is None:
            return lm_loss(output, labels, self.overwrite)
        return cross_entropy(output, labels, "sum", self.overwrite) * self.scale


def trained_positions(windows) -> int | None:
    """Trained label positions in these windows (whole sequences, before cp splits them), or None
    when they carry no loss mask (context.DocumentWindows.loss_mask)."""
    mask = getattr(windows, "loss_mask", None)
    return None if mask is None else int(mask[:, 1:].sum())
