"""Multi-token prediction (MTP, DeepSeek-V3 section 2.2): D blocks after the main model's last layer,
block k predicting, at every position i, the token k+1 places ahead (t[i+k+1]), chained so that
each prediction keeps the causal chain of the ones before it.

Block k takes the previous depth's hidden state h (for k = 1 the main model's last-layer output,
before its final norm) and the embedding of token t[i+k], and runs
    x = eh_proj([enorm(embedding); hnorm(h)])   (embedding first: DeepSeek's released weights' order)
    h = TransformerBlock(x)                      (a block like the main model's layers)
    logits = output(head_norm(h))                (the main model's embedding and output layer, shared)
and its loss is the cross-entropy of those logits against t[i+k+1].

The blocks are ordinary members of the model's `layers` (indices n_layers .. n_layers + D - 1, as
DeepSeek's checkpoints number them), so every parallel dimension lays them out as any layer; a
pipeline keeps them on its last stage, beside the output layer they share.

Targets come in `future` (batch, seq, 1 + D): column j holds, for each position, the token j+1
places ahead (column 0 = the LM labels), IGNORE past the end of the training window (`future_tokens`
makes it from the windows before they are split over ranks). Each depth's loss is the sum over the
positions that have a target divided by all positions: every rank's piece of a sequence and every
micro-batch then averages to the value of the single process (the last k positions of a window have
no target, so this is (seq_len - k)/seq_len of a mean over the others).

As for the MoE auxiliary loss (models/moe/layer.py), the MTP loss reaches the gradients through an autograd
function on the main logits: identity forward, and in backward the loss gets the gradient
`mtp_loss_weight / D` times the micro-batch's weight in its step (models/loss/weight.py). The LM
loss the trainer reports stays the LM loss; the MTP loss of each forward that counts (not
evaluation, not a recomputation) is recorded for the metrics.
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.config import ModelConfig
from fivefold.models.decoder import TransformerBlock, in_compute_dtype
from fivefold.models.forward_kind import counts_for_stats
from fivefold.models.rms_norm import RMSNorm

IGNORE = -100  # F.cross_entropy's ignore_index: a position with no target at this depth


def future_tokens(tokens: torch.Tensor, depth: int) -> torch.Tensor:
    """Windows (batch, seq+1) -> (batch, seq, 1 + depth): column j = the token j+1 places ahead of
    each input position, IGNORE where the window has none."""
    seq = tokens.shape[1] - 1
    padded = torch.cat([tokens, tokens.new_full((tokens.shape[0], depth), IGNORE)], dim=1)
    return torch.stack([padded[:, 1 + j: 1 + j + seq] for j in range(depth + 1)], dim=-1)


class MTPLayer(TransformerBlock):
    """One depth of multi-token prediction: a transformer block whose input combines the previous
    depth's hidden state with the embedding of the token its depth looks ahead to."""

    def __init__(self, cfg: ModelConfig, feed_forward: nn.Module | None, attention: nn.Module | None):
        super().__init__(cfg, feed_forward, attention=attention)
        self.enorm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.head_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)  # before the shared output layer
        self._losses: list[torch.Tensor] = []

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this depth's hidden state, its normalised form for the output layer). The head norm runs
        here, not after the call, so that a layout gathering this block's weights only for its
        forward (FSDP) has it gathered."""
        joined = torch.cat((in_compute_dtype(self.enorm(embedded)), in_compute_dtype(self.hnorm(h))), dim=-1)
        h = super().forward(self.eh_proj(joined), cos, sin, documents)
        return h, in_compute_dtype(self.head_norm(h))

    def record(self, loss: torch.Tensor) -> None:
        if counts_for_stats():  # as the router's statistics: not evaluation, not a recomputation
            self._losses.append(loss.detach())

    def take_losses(self, last: int | None = None) -> list[float]:
        """The recorded losses of the last `last` forwards (all when None), cleared."""
        losses = self._losses[-last:] if last else self._losses
        self._losses = []
        return [float(_local(loss)) for loss in losses]


def mtp_layers(model: nn.Module) -> list[MTPLayer]:
    return [m for m in model.modules() if isinstance(m, MTPLayer)]


def depth_loss(output: nn.Module, normed: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropies where a target exists, over all positions (see the module doc),
    from the shared output layer called with the targets: its fused loss never makes the depth's
    logits (models/loss/linear_cross_entropy.py), in whatever layout the output layer has."""
    return output(normed, targets) / targets.numel()


class AttachScaledLoss(torch.autograd.Function):
    """Identity on `out`; backward also gives `loss` the gradient `scale`, as if `scale·loss` were
    part of the objective. The gradient takes the loss's own kind (a DTensor under a vocabulary-
    parallel loss), so it works whatever the output layer's layout."""

    @staticmethod
    def forward(ctx, out, loss, scale: float):
        ctx.scale, ctx.loss = scale, loss.detach()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, torch.full_like(ctx.loss, ctx.scale), None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
