"""Stacked experts with adapters (models/lora/adapters.py): each expert's gate, up and down projections,
plus (alpha / rank) · B_e A_e dropout(x) beside each targeted one, for the rows routed to expert e.

The base and the low-rank matmuls are grouped over the experts (`torch._grouped_mm`) where the
shapes and the device allow it, else one matmul per expert, as models/moe/layer.py does without adapters.
Every stacked tensor is read through `local` (tensor parallelism's local tensor), so the layouts
that lay out the base experts lay out their adapters the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.models.lora.adapters import A, B, adapter_input


def adapted_swiglu(experts: nn.Module, x: torch.Tensor, counts: list[int], local, biases) -> torch.Tensor:
    """x: (N, dim) rows sorted by expert, counts[e] of them for expert e; `biases` (b1, b2, b3) or None."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    x = x.to(dtype)
    expert = None
    if biases is not None:  # each row's expert, to add its bias
        expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device),
                                         torch.tensor(counts, device=x.device), output_size=x.shape[0])

    def project(name: str, inputs: torch.Tensor, bias) -> torch.Tensor:
        out = per_expert(inputs, local(getattr(experts, name)).to(dtype), counts)
        if bias is not None:
            out = out + bias.to(dtype)[expert]
        a = getattr(experts, f"{name}_{A}", None)
        if a is None:
            return out
        b = getattr(experts, f"{name}_{B}")
        low = per_expert(adapter_input(experts, inputs), local(a).to(dtype), counts)
        return out + per_expert(low, local(b).to(dtype), counts) * experts.lora_scaling

    b1, b2, b3 = biases if biases is not None else (None, None, None)
    hidden = experts.activation(project("w1", x, b1), project("w3", x, b3))
    return project("w2", hidden, b2)


def per_expert(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of expert e times w[e]ᵀ, w: (experts, out, in)."""
    from fivefold.models.moe.layer import grouped_mm_usable
    from fivefold.torch_internals import grouped_mm

    if grouped_mm_usable(x.device, x.dtype, w.shape[2], w.shape[1]):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return grouped_mm(x, w.mT, offs=offsets)
    outs = [F.linear(part, w[e]) for e, part in enumerate(x.split(counts))]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])
