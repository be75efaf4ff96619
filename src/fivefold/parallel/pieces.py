"""What this rank holds, by single-device name: its parameters and persistent buffers, and where
each of its pieces lies inside the whole tensor (tensor parallel's DTensor offsets, the experts of
its ep rank). The names are the same in every layout; materialize.py fills the pieces, and
checkpoint/state_boxes.py saves and loads them."""

from __future__ import annotations

import torch
from torch import nn

from fivefold.parallel.expert.apply import is_expert_param
from fivefold.torch_internals import local_shape_and_global_offset, module_buffers, non_persistent_buffer_names


def named_params(par) -> dict[str, nn.Parameter]:
    """Single-device name -> this rank's parameter (each part's names are the model's names)."""
    return {name: p for part in par.parts for name, p in part.named_parameters()}


def module_persistent_buffers(part: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers of one module saved with the model (MoE bias-balancing state); RoPE tables are
    recomputed."""
    out = {}
    for mod_name, module in part.named_modules():
        for name, buf in module_buffers(module).items():
            if buf is not None and name not in non_persistent_buffer_names(module):
                out[f"{mod_name}.{name}" if mod_name else name] = buf
    return out


def persistent_buffers(par) -> dict[str, torch.Tensor]:
    """Persistent buffers of every part this rank runs."""
    return {name: buf for part in par.parts for name, buf in module_persistent_buffers(part).items()}


def piece_origin(name: str, tensor: torch.Tensor, ep_mesh) -> tuple[list[int], list[int]]:
    """(offsets of this rank's piece, whole shape) of a parameter-like tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        _, offsets = local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        offsets = list(offsets)
    else:
        offsets = [0] * tensor.dim()
    shape = list(tensor.shape)
    if ep_mesh is not None and is_expert_param(name):  # tensor.shape counts this rank's experts
        offsets[0] += ep_mesh.get_local_rank() * shape[0]
        shape[0] *= ep_mesh.size()
    return offsets, shape
