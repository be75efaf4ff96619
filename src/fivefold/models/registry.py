"""The model families (config/families.py lists them): `model.family` -> its folder, models/<family>/.
Adding a family is one line in config/families.py and the folder.

Imports are lazy: the planner asks for a family's statistics without importing torch, the trainer
for its ModelSpec.
"""

from __future__ import annotations

import importlib

from fivefold.config import ConfigError, ModelConfig
from fivefold.config.families import FAMILIES as FAMILY_NAMES, HF_MODEL_TYPES

FAMILIES: dict[str, str] = {family: f"fivefold.models.{family}" for family in FAMILY_NAMES}


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
    return next((family for family, kind in HF_MODEL_TYPES.items() if kind == model_type), None)
