"""AdamW and the learning-rate schedules (warmup, then cosine, WSD or constant)."""

from __future__ import annotations

import math

import torch

from fivefold.config import TrainConfig


def adamw(params, cfg: TrainConfig) -> torch.optim.AdamW:
    """Weight decay applies to every parameter alike.

    Uniform decay keeps the update elementwise, so a ZeRO shard of any slice of any parameter gets
    exactly the update the whole tensor would (torchtitan makes the same choice).
    """
    # One fused kernel for the whole update, on GPU and on CPU alike: on CPU, PyTorch's default
    # (a Python loop of ~10 ops per parameter) costs 3x the fused kernel (benchmarks/RESULTS.md, "Speed").
    # DTensor parameters (tensor parallel, FSDP2; any meshes and placements) get the fused kernel
    # too, but one call may not mix them with plain tensors ("got mixed torch.Tensor and DTensor"):
    # plain and DTensor parameters go into two parameter groups with the same hyperparameters.
    from torch.distributed.tensor import DTensor

    params = list(params)
    fused = True if params and params[0].device.type in ("cpu", "cuda") else None
    if fused:
        for param in params:
            contiguous_for_fused(param)
    kinds = [[p for p in params if not isinstance(p, DTensor)], [p for p in params if isinstance(p, DTensor)]]
    groups = [{"params": kind} for kind in kinds if kind]
    return torch.optim.AdamW(groups or params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                             weight_decay=cfg.weight_decay, fused=fused)


def contiguous_for_fused(param: torch.Tensor) -> None:
    """PyTorch 2.13's fused CPU AdamW silently mis-updates a non-contiguous tensor (6e-2 off after
    3 steps): give a plain parameter contiguous storage of its own (the optimizer updates that in
    place, so nothing else may alias it anyway), and refuse a DTensor, whose local storage belongs
    to its layout (FSDP2's flat shard, a tensor-parallel split) and cannot be swapped here."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        if not param.to_local().is_contiguous():
            raise RuntimeError(f"a {tuple(param.shape)} DTensor parameter has a non-contiguous local "
                               f"shard (strides {param.to_local().stride()}), which fused AdamW would "
                               "mis-update; the layout that built it must give it contiguous storage")
    elif not param.is_contiguous():
        param.data = param.data.contiguous()


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Factor on cfg.lr for optimizer step `step` (0-based)."""
    if cfg.warmup and step < cfg.warmup:
        return (step + 1) / cfg.warmup
    floor = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        span = max(1, cfg.steps - cfg.warmup)
        progress = min(1.0, (step - cfg.warmup) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    # WSD: warmup, a long stable phase at the peak, then a linear decay over the last steps.
    decay_steps = max(1, int(cfg.steps * cfg.decay_fraction))
    decay_start = cfg.steps - decay_steps
    if step < decay_start:
        return 1.0
    return 1.0 - (1 - floor) * min(1.0, (step - decay_start + 1) / decay_steps)


def lr_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
