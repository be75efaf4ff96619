"""From a layout built on the meta device to real memory holding only this rank's pieces.

The model is built, split into pipeline stages, laid out over tp/ep and (at zero 3) sharded by
FSDP2 while every tensor is still on the meta device, where it costs nothing. Then each part is
moved to the target device uninitialised (`to_empty`: a DTensor gets only its local shard) and
every local piece is filled from `fill(name, whole_shape, offsets, sizes)` (models/init.py): the
seeded initialisation, which computes just that box, or a reader of Hugging Face safetensors
slices. No rank allocates a tensor it does not hold; the fill's transient is one tile (seeded) or
one box (files), a tensor at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.models.init import Fill
from fivefold.parallel.grad_norm import local_tensor
from fivefold.parallel.pieces import module_persistent_buffers, piece_origin


def _shared_parameters(part: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) owners of each parameter held by more than one module (a tied
    embedding): `to_empty` gives each owner its own new tensor, so ties are restored after it."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in part.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, attr))
    return [o for o in owners.values() if len(o) > 1]


BLOCK_ELEMENTS = 2**24  # 64 MiB of fp32: the most a fill produces at once


def _row_blocks(local: torch.Tensor):
    """(first row, rows) blocks along dim 0 of at most BLOCK_ELEMENTS each (at least one row), so
    that a fill's transient stays bounded however large this rank's piece of a tensor is."""
    step = max(1, BLOCK_ELEMENTS // max(1, local[0].numel() if len(local) else 1))
    for start in range(0, len(local), step):
        yield start, min(step, len(local) - start)


def cast_parameters(part: nn.Module, dtype: torch.dtype) -> None:
    """Give a (meta-device) part's parameters `dtype`; buffers keep theirs (RoPE frequencies and
    MoE balancing biases stay fp32). In place: parameters keep their identity (ties, references)."""
    buffers = [(module, name, buf) for module in part.modules() for name, buf in module._buffers.items()
               if buf is not None]
    part.to(dtype)
    for module, name, buf in buffers:
        module._buffers[name] = buf


@torch.no_grad()
def materialize(parts: list[nn.Module], device: torch.device, fill: Fill, ep_mesh=None,
                round_params_to: torch.dtype | None = None) -> None:
    """Allocate each (meta-device) part's pieces on `device` and fill them. `round_params_to`:
    parameters start from their initial values rounded to that dtype (bf16 runs start from the
    same bf16 weights in every layout, whether a layout keeps them in bf16 or as fp32 shards)."""
    for part in parts:
        shared = _shared_parameters(part)
        part.to_empty(device=device)
        for owners in shared:
            module, attr = owners[0]
            for other, other_attr in owners[1:]:
                setattr(other, other_attr, getattr(module, attr))
        params = {id(p) for p in part.parameters()}
        for name, tensor in [*part.named_parameters(), *module_persistent_buffers(part).items()]:
            local = local_tensor(tensor)
            offsets, shape = piece_origin(name, tensor, ep_mesh)
            rounding = round_params_to if id(tensor) in params else None

            def values(box, sizes):
                value = fill(name, tuple(shape), box, sizes)
                return value.to(rounding) if rounding is not None else value
            if local.dim() == 0:
                local.copy_(values((), ()))
                continue
            for start, rows in _row_blocks(local):
                local[start:start + rows].copy_(values((offsets[0] + start, *offsets[1:]), (rows, *local.shape[1:])))
        reset = getattr(part, "reset_computed_buffers", None)
        if reset is not None:
            reset()
