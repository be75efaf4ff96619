"""The weight of the micro-batch being run in its step's loss, for the losses a model adds beside
the LM loss (the MoE auxiliary loss, multi-token prediction): they reach the gradients through
autograd functions in the model (models/moe/layer.py, models/mtp.py), so they must weigh as the caller
weighs each micro-batch's LM loss (1 / micro-batches per step), inside a pipeline stage too.

The training loop states it around a step's forwards, as autocast states the compute dtype:
`with micro_batch_weight(1 / n_micro): ...`. Outside any such block the weight is 1. The value is a
plain module global, not a context variable, so that a compiled block reads it as a constant
(torch.compile guards on it) and the autograd functions capture it at forward time.
"""

from __future__ import annotations

from contextlib import contextmanager

_weight = 1.0


@contextmanager
def micro_batch_weight(weight: float):
    """The forwards inside weigh `weight` in their step's loss."""
    global _weight
    before, _weight = _weight, weight
    try:
        yield
    finally:
        _weight = before


def current_micro_batch_weight() -> float:
    return _weight
