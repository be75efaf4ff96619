"""Adapters (models/lora/adapters.py) laid out with the tensor-parallel layer they sit beside.

y = W x + s · B A x. The adapter follows its layer so that it adds no collective of its own:
- column-parallel W (rows = output features split): B is split the same way and A is replicated.
  Each rank computes A x on the whole input and its own output features of B (A x); A's gradient
  from them is a partial sum over the tp ranks (summed where gradients are settled, as for every
  Partial-gradient weight).
- row-parallel W (input features split): A is split by its input features too, so A x is a partial
  sum, as W x is; B, replicated, maps it to a partial output, which is added to W x's partial sums
  before their one reduction. B's gradient from a partial A x is partial too.
- replicated W whose gradient is partial (a latent down-projection, a per-token stream layer): A
  and B replicated, both gradients partial.
The same layers compute the adapters as the base (parallel/tensor/layers.py), on local shards.
"""

from __future__ import annotations

import functools

from torch import nn

from fivefold.models.lora.adapters import A, add_adapter, adapter_output
from fivefold.models.spec import TP
from fivefold.parallel.tensor.layers import ColumnParallelLinear, PartialGradLinear, RowParallelLinear

ADAPTER_ATTRIBUTES = ("lora_scaling", "lora_dropout")


def carry_adapter(old: nn.Module, new: nn.Module, style: str, group) -> None:
    """Give `new`, the tensor-parallel layer that replaced `old`, `old`'s adapter (if it has one)."""
    if not hasattr(old, A):
        return
    for attribute in ADAPTER_ATTRIBUTES:
        setattr(new, attribute, getattr(old, attribute))
    if style == TP.COLUMN:
        new.lora_A, new.lora_B = PartialGradLinear(old.lora_A, group), ColumnParallelLinear(old.lora_B, group)
        new.register_forward_hook(add_adapter)
    elif style in (TP.ROW_TO_SEQUENCE, TP.ROW_TO_TOKENS):
        new.lora_A = RowParallelLinear(old.lora_A, group, reduce=_partial_sums)
        new.lora_B = PartialGradLinear(old.lora_B, group)
        # Added to the base's partial sums inside the layer, before its one reduction.
        new.matmul = functools.partial(_with_adapter, new.matmul, new)
    elif style in (TP.REPLICATED_PARTIAL, TP.STREAM_LINEAR):
        new.lora_A, new.lora_B = PartialGradLinear(old.lora_A, group), PartialGradLinear(old.lora_B, group)
        new.register_forward_hook(add_adapter)
    else:
        raise ValueError(f"an adapter sits beside a layer of tensor-parallel style '{style}', which has no "
                         "adapter layout; leave it out of lora.targets")


def carry_expert_attributes(old: nn.Module, new: nn.Module) -> None:
    """Stacked experts re-made for tensor parallelism keep their adapters' scaling and dropout (the
    stacked adapters themselves are parameters, re-made with the experts)."""
    for attribute in ADAPTER_ATTRIBUTES:
        if hasattr(old, attribute):
            setattr(new, attribute, getattr(old, attribute))


def _partial_sums(t):
    return t  # reduced with the base's partial sums, by the layer the adapter sits beside


def _with_adapter(matmul, layer: nn.Module, x, weight):
    return matmul(x, weight) + adapter_output(layer, x).to(x.dtype)
