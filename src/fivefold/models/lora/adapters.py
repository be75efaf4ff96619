"""LoRA: low-rank adapters beside the targeted linear layers of a plain single-device model.

Each targeted `nn.Linear` gets two children, `lora_A` (rank x in) and `lora_B` (out x rank), and
computes y = W x (+ b) + (alpha / rank) · B A dropout(x) (LoRA, Hu et al. 2021; the scaling and
the names are PEFT's, so that `<linear>.lora_A.weight` maps onto PEFT's
`base_model.model.<Hugging Face module>.lora_A.weight`). Stacked experts (models/moe/layer.py `Experts`)
get stacked adapters beside each targeted projection: `w1_lora_A` (experts, rank, in) and
`w1_lora_B` (experts, out, rank), so expert parallelism slices them with their experts
(models/lora/experts.py computes them).

At the start A is drawn as PEFT draws it (Kaiming-uniform with a = sqrt(5): U(±1/sqrt(in))) and
B is zero, so the adapted model starts as the base model. A's values come from the seed tile by
tile (models/init.py), so every layout draws the same A. Everything but the adapters is frozen
(`freeze_all_but_adapters`): no gradients, no optimizer state, no data-parallel reduction.

Nothing here knows about parallelism: tensor parallelism lays the adapters out beside their layer
(parallel/tensor/lora.py), and the adapter's output is added by a forward hook, `add_adapter`,
which reads the layer's children whatever their layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.models.init import Fill, constant, seeded_uniform

A, B = "lora_A", "lora_B"
# The stacked experts' projections an adapter can sit beside (models/moe/layer.py `Experts`).
EXPERT_PROJECTIONS = ("w1", "w2", "w3")


def is_adapter(name: str) -> bool:
    """Whether a parameter (by its single-device name) is an adapter's A or B."""
    return name.endswith((f".{A}.weight", f".{B}.weight", f"_{A}", f"_{B}"))


def add_adapters(model: nn.Module, lora) -> list[str]:
    """Adapters beside the linear layers `lora.targets` selects (the [lora] section; rank > 0).
    Returns the adapted weights' names; none is a config problem (one sentence)."""
    from fivefold.config.errors import ConfigError
    from fivefold.config.lora import parse_targets
    from fivefold.models.moe.layer import Experts
    from fivefold.models.param_kinds import param_kinds

    targets, kinds = parse_targets(lora.targets), param_kinds(model)
    scaling = lora.alpha / lora.rank
    adapted = []
    for module_name, module in list(model.named_modules()):
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, nn.Linear) and targets.selects(prefix + "weight", kinds.get(prefix + "weight", "")):
            _beside_linear(module, lora.rank, scaling, lora.dropout)
            adapted.append(prefix + "weight")
        elif isinstance(module, Experts):
            for projection in EXPERT_PROJECTIONS:
                name = prefix + projection
                if targets.selects(name, kinds.get(name, "")):
                    _beside_experts(module, projection, lora.rank, scaling, lora.dropout)
                    adapted.append(name)
    if not adapted:
        raise ConfigError(f"lora.targets='{lora.targets}' selects no linear layer of this model; name kinds "
                          "among attention, mlp, experts, or a pattern matching weights such as "
                          "'layers.0.attention.wq.weight'")
    return adapted


def _beside_linear(linear: nn.Linear, rank: int, scaling: float, dropout: float) -> None:
    device = linear.weight.device
    linear.lora_A = nn.Linear(linear.in_features, rank, bias=False, device=device)
    linear.lora_B = nn.Linear(rank, linear.out_features, bias=False, device=device)
    linear.lora_scaling, linear.lora_dropout = scaling, dropout
    linear.register_forward_hook(add_adapter)


def _beside_experts(experts: nn.Module, projection: str, rank: int, scaling: float, dropout: float) -> None:
    weight = getattr(experts, projection)  # (experts, out, in)
    n, out, inp = weight.shape
    setattr(experts, f"{projection}_{A}", nn.Parameter(torch.empty(n, rank, inp, device=weight.device)))
    setattr(experts, f"{projection}_{B}", nn.Parameter(torch.empty(n, out, rank, device=weight.device)))
    experts.lora_scaling, experts.lora_dropout = scaling, dropout


def adapter_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x with the adapter's dropout, only while training: evaluation runs without gradients."""
    p = module.lora_dropout
    return F.dropout(x, p, training=torch.is_grad_enabled()) if p else x


def adapter_output(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(alpha / rank) · B A dropout(x), through the layer's `lora_A` and `lora_B` children."""
    return module.lora_B(module.lora_A(adapter_input(module, x))) * module.lora_scaling


def add_adapter(module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
    """Forward hook of an adapted layer: its output plus the adapter's."""
    return out + adapter_output(module, args[0]).to(out.dtype)


def freeze_all_but_adapters(model: nn.Module) -> None:
    """Only the adapters are trained. Called once the layout has made its parameters (tensor and
    expert parallelism make new ones), before any gradient or optimizer state exists."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))


def adapter_initial_values(fill: Fill, seed: int) -> Fill:
    """`fill` with the adapters' initial values: A Kaiming-uniform (a = sqrt(5), fan-in = in: the
    bound 1/sqrt(in), as PEFT's `reset_lora_parameters`), B zero; every other tensor from `fill`."""
    def with_adapters(name: str, shape, offsets, sizes) -> torch.Tensor:
        if name.endswith((f".{A}.weight", f"_{A}")):
            return seeded_uniform(seed, name, shape, 1 / math.sqrt(shape[-1]), offsets, sizes)
        if name.endswith((f".{B}.weight", f"_{B}")):
            return constant(0.0, sizes)
        return fill(name, shape, offsets, sizes)
    return with_adapters


def describe_adapters(model: nn.Module, lora) -> str:
    """The run log's line: what is adapted and how much of the model trains (`model`: meta is enough)."""
    params = dict(model.named_parameters())
    adapters = sum(p.numel() for n, p in params.items() if is_adapter(n))
    total = sum(p.numel() for p in params.values())
    layers = sum(1 for n in params if n.endswith((f".{A}.weight", f"_{A}")))
    return (f"lora: rank {lora.rank}, alpha {lora.alpha:g} (scale {lora.alpha / lora.rank:g}) beside {layers} "
            f"linear layers ('{lora.targets}'): {adapters / 1e6:.3g}M trainable parameters of {total / 1e6:.3g}M "
            f"({100 * adapters / total:.2g}%), the base frozen")
