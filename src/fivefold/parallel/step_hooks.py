"""What a feature adds to every training step, registered with the façade (parallel/parallelized.py)
by parallelize() instead of the façade knowing each feature.

A hook sees the step twice: before the step's forward passes (`before_step`, with the number of
micro-batches) and after the optimizer step (`after_optimizer_step`, returning metrics for the
step's record). The hooks of a layout: MoE router statistics and bias balancing
(parallel/expert/apply.py), hot-expert replicas (parallel/expert/replicas.py) and multi-token
prediction's loss (here: it spans the pipeline and data-parallel ranks, not one dimension).
"""

from __future__ import annotations

import torch

from fivefold.models.mtp import mtp_layers
from fivefold.parallel.collectives import all_reduce_scalars


class StepHook:
    def before_step(self, par, n_micro: int) -> None:
        """Before the forward passes of a step of `n_micro` micro-batches on this rank."""

    def after_optimizer_step(self, par, optimizer: torch.optim.Optimizer) -> dict:
        """After the optimizer step: metrics for metrics.jsonl (empty when there are none)."""
        return {}


class MultiTokenPredictionStep(StepHook):
    """Multi-token prediction (models/mtp.py): its loss joins the gradients with each micro-batch's
    weight (models/loss/weight.py, stated by Parallelized.forward_backward), and `mtp_loss` reports
    it (mean over its depths and the step's micro-batches, over the global batch), unweighted. Only the last pipeline stage computes it; every rank gets it."""

    def __init__(self, depth: int):
        self.depth = depth

    def after_optimizer_step(self, par, optimizer) -> dict:
        mine = sum(sum(layer.take_losses(last=par.n_micro)) for part in par.parts for layer in mtp_layers(part))
        value = par.mean_over_dp(mine / (par.n_micro * self.depth))
        if par.pipeline is not None:
            value = all_reduce_scalars([value], par.pipeline.pp_group, par.device).item()
        return {"mtp_loss": value}
