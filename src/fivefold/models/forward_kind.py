"""Which forwards a step's per-forward records count (MoE router statistics, multi-token
prediction's losses, QK-clip's logit maxima).

A record is kept for a training forward and skipped for evaluation (no grad) and for the forward
that recomputation repeats inside backward. The records then hold one entry per forward of the
step plus, on a pipeline stage's first step, one more at their start: torch's pipelining infers the
stage's shapes with a real forward on uninitialised inputs. So a step reads its last n_micro
records, never all of them.
"""

from __future__ import annotations

import torch

from fivefold.torch_internals import current_graph_task_id


def counts_for_stats() -> bool:
    """True in a training forward outside backward: not evaluation, not a recomputation."""
    return torch.is_grad_enabled() and current_graph_task_id() == -1
