"""fivefold's LoRA adapters under PEFT's names: which Hugging Face module each adapter sits beside.

PEFT saves the adapter of the module at `<path>` (its name in the transformers model) as
`base_model.model.<path>.lora_A.weight` (rank x in) and `.lora_B.weight` (out x rank). The module
paths come from the family's Hugging Face adapter (models/<family>/hf.py), the table that names
every weight for `fivefold convert`, so nothing here restates a family's names: an adapter beside
our `layers.0.attention.wq.weight` sits beside the module of that weight's Hugging Face name.

Stacked experts (experts, out, in) whose Hugging Face files keep one matrix per expert (Mixtral,
Qwen3-MoE, DeepSeek-V3: `...experts.{e}.w1.weight`) get one adapter per expert, the e-th slices
of ours. A weight that Hugging Face stores inside a fused tensor (gpt-oss's `gate_up_proj`, gate
and up interleaved) has no module of its own for a PEFT adapter: refused in one sentence.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fivefold.config import ConfigError
from fivefold.models.lora import A, B, is_adapter
from fivefold.models.registry import model_spec

PREFIX = "base_model.model."  # PeftModel wraps the transformers model twice (LoraModel, then PeftModel)


@dataclass(frozen=True)
class PeftNames:
    # our adapter tensor -> [(PEFT tensor name, expert index or None)]; per expert, the e-th slice of ours
    tensors: dict[str, list[tuple[str, int | None]]]
    # adapter_config.json's target_modules: the module leaf names ("q_proj") when every module of
    # those names is adapted, else the full module paths (PEFT matches a name or a path's end)
    target_modules: list[str]


def adapted_weight(adapter_name: str) -> str:
    """The base weight an adapter tensor sits beside: `x.wq.lora_A.weight` -> `x.wq.weight`,
    stacked `x.experts.w1_lora_A` -> `x.experts.w1`."""
    for which in (A, B):
        if adapter_name.endswith(f".{which}.weight"):
            return adapter_name.removesuffix(f".{which}.weight") + ".weight"
        if adapter_name.endswith(f"_{which}"):
            return adapter_name.removesuffix(f"_{which}")
    raise ValueError(f"{adapter_name} is not an adapter tensor")


def _modules(hf_adapter, weight: str, n_experts: int, targets: str) -> list[str]:
    """The Hugging Face modules (one, or one per expert) holding our `weight`."""
    part = hf_adapter.part_of(weight)
    if part is not None:
        raise ConfigError(f"lora.targets='{targets}' adapts {weight}, which Hugging Face's {hf_adapter.model_type} "
                          f"stores inside the fused tensor {part[0]}, where PEFT has no layer to load an adapter; "
                          "leave the experts out of lora.targets (e.g. 'attention|mlp') to export a PEFT adapter, "
                          "or write the merged model instead (fivefold convert --merge CKPT DST)")
    names = hf_adapter.hf_sources(weight, n_experts)
    return [name.removesuffix(".weight") for name in names]


def peft_names(cfg, lora) -> PeftNames:
    """PEFT's names for the adapters [lora] puts into the model of `cfg` (a meta-device model: no
    memory); ConfigError for an adapter PEFT cannot load."""
    from fivefold.models import build_meta_model

    hf_adapter = model_spec(cfg).hf
    n_experts = cfg.moe.n_experts
    model = build_meta_model(cfg, lora)
    tensors: dict[str, list[tuple[str, int | None]]] = {}
    adapted: set[str] = set()
    for name, _ in model.named_parameters():
        if not is_adapter(name):
            continue
        weight = adapted_weight(name)
        which = A if name.endswith((f".{A}.weight", f"_{A}")) else B
        modules = _modules(hf_adapter, weight, n_experts, lora.targets)
        stacked = hf_adapter.is_stacked(weight)
        tensors[name] = [(f"{PREFIX}{module}.{which}.weight", e if stacked else None) for e, module in enumerate(modules)]
        adapted.update(modules)
    return PeftNames(tensors, _target_modules(cfg, adapted))


def _target_modules(cfg, adapted: set[str]) -> list[str]:
    from fivefold.models import build_meta_model

    hf_adapter = model_spec(cfg).hf
    every = defaultdict(set)  # leaf name -> every Hugging Face module path of that leaf holding a weight
    for name, _ in build_meta_model(cfg).named_parameters():
        if hf_adapter.is_stacked(name):
            sources = hf_adapter.hf_sources(name, cfg.moe.n_experts)
        elif hf_adapter.part_of(name) is None and hf_adapter.maybe_hf_name(name) is not None:
            sources = [hf_adapter.maybe_hf_name(name)]
        else:
            continue  # a fused tensor: no adapter sits beside it (refused above)
        for hf in sources:
            module = hf.rpartition(".")[0]
            every[module.rpartition(".")[2]].add(module)
    leaves = {module.rpartition(".")[2] for module in adapted}
    if all(every[leaf] <= adapted for leaf in leaves):
        return sorted(leaves)
    return sorted(adapted)
