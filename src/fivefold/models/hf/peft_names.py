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

`load_peft_folder` reads such a folder back onto its base (the same names, the other way).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fivefold.config import ConfigError
from fivefold.models.lora.adapters import A, B, is_adapter
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


def hf_name_of(cfg, name: str) -> str:
    """The Hugging Face name of one of our tensors (for sentences)."""
    return model_spec(cfg).hf.maybe_hf_name(name) or name


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
    _refuse_expert_namesakes(cfg, lora, hf_adapter, adapted)
    return PeftNames(tensors, _target_modules(cfg, adapted))


def _refuse_expert_namesakes(cfg, lora, hf_adapter, adapted: set[str]) -> None:
    """PEFT 0.21 on transformers 5 turns every adapter whose module is named like a per-expert
    projection (DeepSeek-V3's and Qwen3-MoE's gate_proj, up_proj, down_proj) into one on the fused
    experts, so an adapter beside a dense MLP or a shared expert of that name would be misplaced
    (measured on DeepSeek-V3: logits 0.77 off)."""
    from fivefold.models import build_meta_model

    expert_leaves = {hf.removesuffix(".weight").rpartition(".")[2]
                     for name, _ in build_meta_model(cfg).named_parameters() if hf_adapter.is_stacked(name)
                     for hf in hf_adapter.hf_sources(name, 1)}
    for module in sorted(adapted):
        if module.rpartition(".")[2] in expert_leaves and ".experts." not in module:
            raise ConfigError(f"lora.targets='{lora.targets}' adapts {module}, named like the routed experts' "
                              f"{module.rpartition('.')[2]}, and PEFT (on transformers 5) moves every adapter of that "
                              "name onto the fused experts, so it would load this one wrongly; leave mlp out of "
                              "lora.targets (e.g. 'attention|experts') to export a PEFT adapter, or write the merged "
                              "model instead (fivefold convert --merge CKPT DST)")


def check_peft_export(cfg, lora) -> None:
    """What a LoRA run with checkpoint.export_hf would fail to export, said at launch: an adapter
    PEFT cannot load, or a router bias the run moves (a PEFT folder holds adapters only)."""
    peft_names(cfg, lora)
    m = cfg.moe
    if m.n_experts and m.balance == "bias" and m.bias_update_rate > 0:
        raise ConfigError(f"checkpoint.export_hf writes a PEFT adapter folder, which holds adapters only, and "
                          f"model.moe.balance='bias' moves the routers' expert_bias during the run (bias_update_rate="
                          f"{m.bias_update_rate:g}); unset checkpoint.export_hf and write the merged model after the "
                          "run (fivefold convert --merge CKPT DST), which carries the moved bias")


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


# --------------------------------------------------------------------------------------------
# Reading a PEFT adapter folder back (fivefold.load_pretrained, fivefold generate)

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# adapter_config.json settings whose LoRA fivefold does not compute, with the value that it does
_PLAIN_LORA = {"peft_type": "LORA", "use_dora": False, "use_rslora": False, "bias": "none", "fan_in_fan_out": False,
               "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None, "target_parameters": None}


def _adapter_config(folder: Path, base_override: str = "") -> dict:
    from fivefold.config.file_errors import guarded

    file = folder / ADAPTER_CONFIG
    with guarded(file, "read", "export the adapter again"):
        text = file.read_text()
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{file} is not valid JSON ({err}); export the adapter again") from None
    for key, plain in _PLAIN_LORA.items():
        value = config.get(key, plain)
        if value != plain and not (not value and not plain):  # an empty pattern or list is the plain value
            raise ConfigError(f"{file} sets {key}={config[key]!r}, which fivefold's LoRA does not compute (it reads "
                              f"plain LoRA: {key}={plain!r}); merge the adapter with peft and load the merged folder")
    if base_override:
        if not (Path(base_override) / "config.json").is_file():
            raise ConfigError(f"--base {base_override} is not a Hugging Face folder (no config.json); give the base "
                              "model the adapter was trained on")
        return config
    base = config.get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise ConfigError(f"{file} names base_model_name_or_path={base!r}, which is not a Hugging Face folder on "
                          "this machine; set it to the local folder of the base model the adapter was trained on, "
                          "or give it with --base FOLDER")
    return config


def load_peft_folder(folder, base: str = "") -> nn.Module:
    """The single-device model of a PEFT LoRA adapter folder: the base its adapter_config.json names
    (a local Hugging Face folder), or `base` (`--base`) where that is elsewhere, with the adapters
    beside the modules adapter_model.safetensors names (fp32)."""
    from safetensors.torch import load_file

    from fivefold.config.schema import LoraConfig
    from fivefold.models.hf.interop import load_pretrained
    from fivefold.models.lora.adapters import add_adapters

    folder = Path(folder)
    config = _adapter_config(folder, base)
    if base:
        config = {**config, "base_model_name_or_path": str(base)}
    model = load_pretrained(config["base_model_name_or_path"])
    stored = load_file(str(folder / ADAPTER_WEIGHTS))
    lora = LoraConfig(rank=int(config["r"]), alpha=float(config["lora_alpha"]), dropout=0.0,
                      targets="attention|mlp|experts")
    try:
        names = peft_names(model.cfg, lora)
    except ConfigError:  # fused experts (gpt-oss) carry no PEFT adapter: the rest may
        names = peft_names(model.cfg, dataclasses.replace(lora, targets="attention|mlp"))
    known = {peft for targets in names.tensors.values() for peft, _ in targets}
    unknown = sorted(set(stored) - known)
    if unknown:
        raise ConfigError(f"{folder / ADAPTER_WEIGHTS} holds {unknown[0]}, which is no LoRA A or B of a module "
                          f"of the base {config['base_model_name_or_path']}; check base_model_name_or_path")
    present = {ours: targets for ours, targets in names.tensors.items() if all(p in stored for p, _ in targets)}
    weights = sorted({adapted_weight(ours) for ours in present})
    if not weights:
        raise ConfigError(f"{folder / ADAPTER_WEIGHTS} holds no LoRA adapter; export the adapter again")
    add_adapters(model, dataclasses.replace(lora, targets="re:^(" + "|".join(map(re.escape, weights)) + ")$"))
    with torch.no_grad():
        for ours, targets in present.items():
            param = model.get_parameter(ours)
            for peft, expert in targets:
                into = param if expert is None else param[expert]
                if tuple(stored[peft].shape) != tuple(into.shape):
                    raise ConfigError(f"{folder / ADAPTER_WEIGHTS}: {peft} has shape {list(stored[peft].shape)}, "
                                      f"and the base's module needs {list(into.shape)}; the adapter was trained on "
                                      "another base or rank")
                into.copy_(stored[peft])
    return model
