"""Collectives of host numbers, and the device rule every collective of a step follows.

The rule: a tensor handed to a collective lives on the device the model computes on (rt.device).
parallel.backend may be pure nccl, which refuses host tensors; gloo and `cpu:gloo,cuda:nccl` (auto on
CUDA) take device tensors too, so this one placement works under every value. Numbers that start
on the host (a loss, a norm, a step time, router counts) are copied to the device for their
all-reduce and back after: a few bytes, a few times per step. PyTorch's object collectives
(checkpoint metadata) place their bytes by the group's backends themselves, on the current CUDA
device (set in runtime.py). tests/test_collective_devices.py checks the rule on real steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_scalars(values: list[float] | torch.Tensor, group, device: torch.device) -> torch.Tensor:
    """The sum over `group` (None: the world) of a few numbers, in fp64, returned on the host.
    The caller's tensor is left as it was."""
    if isinstance(values, torch.Tensor):
        tensor = values.to(device, torch.float64, copy=True)
    else:
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, group=group)
    return tensor.cpu()
