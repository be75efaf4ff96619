"""The language-model loss of one micro-batch, and how loss masks keep it the global batch's mean.

Plain text trains every position, and every micro-batch of every rank holds as many, so the mean of
the micro-batch means (gradient accumulation divides by their number, data parallelism averages
over its ranks) is the mean over the global batch. Chat data (`fivefold prepare --chat`) trains only
the replies: micro-batches hold different numbers of trained tokens, and a mean of means would weigh
a token of a short reply more than one of a long reply, differently in every layout. So with a loss
mask each micro-batch's loss is the *sum* over its trained positions times one factor for the whole
step, (micro-batches · ranks the mean is later taken over) / (trained positions of the global
batch): the same averaging then yields the global batch's mean over its trained tokens, in every
layout, with the same gradient arithmetic as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100  # the label of a position that is not trained (F.cross_entropy's default ignore_index)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position (fp32 for a stable log-softmax). Labels
    (batch, seq, 1 + mtp_depth) carry multi-token prediction's targets too (models/mtp.py): the
    LM labels are their first column."""
    if labels.dim() == 3:
        labels = labels[..., 0]
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class LMLoss:
    """`lm_loss`, or under a loss mask the scaled sum over trained positions (`scale` set per step
    by Parallelized; None = plain text). One object, given to the pipeline schedule too, so both
    paths read the same factor."""

    def __init__(self):
        self.scale: float | None = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return lm_loss(logits, labels)
        if labels.dim() == 3:
            labels = labels[..., 0]
        total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        return total * self.scale


def trained_positions(windows) -> int | None:
    """Trained label positions in these windows (whole sequences, before cp splits them), or None
    when they carry no loss mask (context.DocumentWindows.loss_mask)."""
    mask = getattr(windows, "loss_mask", None)
    return None if mask is None else int(mask[:, 1:].sum())
