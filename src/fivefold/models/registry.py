"""The model families: `model.family` -> its folder. Adding a family is one line here (and the folder).

Imports are lazy: the planner asks for a family's statistics without importing torch, the trainer
for its ModelSpec.
"""

from __future__ import annotations

import importlib

from fivefold.config import ConfigError, ModelConfig

FAMILIES: dict[str, str] = {
    "llama": "fivefold.models.llama",  # Llama 3.x, dense
    "mixtral": "fivefold.models.mixtral",  # the Llama block with an MoE feed-forward
    "qwen3": "fivefold.models.qwen3",  # Qwen3 dense: per-head q/k RMSNorm, explicit head_dim
    "qwen3_moe": "fivefold.models.qwen3_moe",  # Qwen3-MoE: fine-grained experts, dense layers by list
    "deepseek_v3": "fivefold.models.deepseek_v3",  # DeepSeek-V3: latent attention, YaRN, grouped routing
    "gpt_oss": "fivefold.models.gpt_oss",  # gpt-oss: sliding windows, attention sinks, biases, clamped SwiGLU experts
}


def family_module(family: str, part: str):
    if family not in FAMILIES:
        raise ConfigError(f"model.family '{family}' is unknown; choose one of {', '.join(FAMILIES)}")
    return importlib.import_module(f"{FAMILIES[family]}.{part}")


def model_spec(cfg: ModelConfig | str):
    """The ModelSpec of a config (or of a family by name)."""
    return family_module(cfg if isinstance(cfg, str) else cfg.family, "spec").SPEC


def family_stats(cfg: ModelConfig):
    """The planner's ModelStats of a config, from its family's stats.py (no torch)."""
    return family_module(cfg.family, "stats").stats(cfg)


def family_of_hf_model_type(model_type: str) -> str | None:
    """The family whose Hugging Face adapter reads config.json files of this `model_type`."""
    for family in FAMILIES:
        if model_spec(family).hf.model_type == model_type:
            return family
    return None
