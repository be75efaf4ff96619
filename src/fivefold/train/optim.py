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
    return torch.optim.AdamW(groups or params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay, fused=fused)


def build_optimizer(params, settings_of, cfg: TrainConfig, muon_layout=None) -> torch.optim.Optimizer:
    """The optimizer over `params` (what this rank updates: parameters or ZeRO chunks), each in the
    parameter group of its settings (`settings_of(tensor)`, config/param_groups.py; None: the base
    settings). A group's lr is train.lr x its lr_scale; the schedule multiplies every group alike.
    Muon's tensors go to train/muon.py (`muon_layout`: how this layout orthogonalises them whole)
    and the rest to fused AdamW, chained into one optimizer for the schedule and checkpoints."""
    from torch.distributed.tensor import DTensor

    from fivefold.config.param_groups import GroupSettings

    params = list(params)
    base = GroupSettings(1.0, cfg.weight_decay, "adamw")
    groups: dict = {}  # (settings, is DTensor) -> tensors: fused AdamW may not mix the two
    for param in params:
        groups.setdefault((settings_of(param) or base, isinstance(param, DTensor)), []).append(param)
    adam = [{"params": ps, "lr": cfg.lr * s.lr_scale, "weight_decay": s.weight_decay}
            for (s, _), ps in groups.items() if s.optimizer == "adamw"]
    muon = [{"params": ps, "lr": cfg.lr * s.lr_scale, "weight_decay": s.weight_decay}
            for (s, _), ps in groups.items() if s.optimizer == "muon"]
    optimizers = []
    if adam or not muon:
        fused = True if params and params[0].device.type in ("cpu", "cuda") else None
        for group in adam if fused else []:
            for param in group["params"]:
                contiguous_for_fused(param)
        optimizers.append(torch.optim.AdamW(adam or params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                                            weight_decay=cfg.weight_decay, fused=fused))
    if muon:
        from fivefold.train.muon import Muon

        optimizers.append(Muon(muon, lr=cfg.lr, momentum=cfg.muon_momentum, adjust_lr_fn=cfg.muon_adjust_lr,
                               layout=muon_layout, ns_dtype=cfg.muon_ns_dtype))
    return optimizers[0] if len(optimizers) == 1 else Chained(optimizers)


class Chained(torch.optim.Optimizer):
    """Several optimizers over disjoint tensors as one: one list of parameter groups (the
    schedule scales them all), one state dict (checkpoints read and fill it), one step."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):  # noqa: no super().__init__: no params of its own
        self.optimizers, self.defaults = optimizers, {}
        self.param_groups = [g for o in optimizers for g in o.param_groups]
        self.state = optimizers[0].state
        for other in optimizers[1:]:
            self.state.update(other.state)
            other.state = self.state  # keys are distinct tensors, so one dict serves all
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = {}, {}

    @torch.no_grad()
    def step(self, closure=None):
        for optimizer in self.optimizers:
            optimizer.step()

    def owner(self, tensor: torch.Tensor) -> torch.optim.Optimizer:
        return next(o for o in self.optimizers for g in o.param_groups for p in g["params"] if p is tensor)


def muon_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors Muon updates (parameters or ZeRO chunks), in its order."""
    from fivefold.train.muon import Muon

    parts = optimizer.optimizers if isinstance(optimizer, Chained) else [optimizer]
    return [p for o in parts if isinstance(o, Muon) for g in o.param_groups for p in g["params"]]


def state_keys(optimizer: torch.optim.Optimizer, tensor: torch.Tensor) -> tuple[str, ...]:
    """The state tensors `optimizer` keeps for `tensor` (what checkpoints save)."""
    from fivefold.train.muon import Muon

    from fivefold.checkpoint.resume_optimizer import STATE_KEYS

    owner = optimizer.owner(tensor) if isinstance(optimizer, Chained) else optimizer
    return STATE_KEYS["muon" if isinstance(owner, Muon) else "adamw"]


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
