"""A config as the trainer and the planner take it: loaded with the families' readers of a Hugging
Face config.json (model.init_from), and checked by every rule before any process group exists.

`validate` is the one gate, in three stages:
- keys: config/ is the bottom layer and knows no model code; its rules read keys only (no torch);
- model: the rules that need the model code (the family's own checks, a Hugging Face export's, and
  those depending on a model's parameters: their names, kinds and shapes), in model_rules.py; a
  meta-device model is built only for a config that asks for what it decides;
- machine (`on_this_machine=True`): what this machine cannot run (backend, FP8 kernels), in
  machine.py.
The trainer's start-up, every CLI command, `fivefold plan` and the layout search all call it, so
one set of rules decides what is refused; a plan is for another machine, so the planner runs the
first two stages and the commands that run here all three.
"""

from __future__ import annotations

from pathlib import Path

from fivefold.config import Config, ModelConfig
from fivefold.config import load as config_load
from fivefold.config.validate import validate as validate_keys
from fivefold.configure.machine import check_machine
from fivefold.configure.model_rules import check_family, check_lora_targets, check_param_groups


def read_model_folder(folder: Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face folder's config.json (the families' adapters read it)."""
    from fivefold.models.hf.stream import read_hf_config  # imports torch: only for a config naming a folder

    return read_hf_config(folder)


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> Config:
    """TOML file (optional, or a shipped config's name) plus overrides -> a resolved Config, not yet validated."""
    return config_load.load_config(path, overrides, read_model_folder)


def config_from_dict(raw: dict) -> Config:
    return config_load.config_from_dict(raw, read_model_folder)


def validate(cfg: Config, world_size: int | None = None, *, on_this_machine: bool = False) -> Config:
    """Raise ConfigError on the first problem; return the config when it is sound (parallel.dp = 0
    resolved from the world size: config/validate.py). on_this_machine: the config is to run here,
    so this machine's own refusals apply too."""
    validate_keys(cfg, world_size)
    check_family(cfg)
    check_param_groups(cfg)
    check_lora_targets(cfg)
    if on_this_machine:
        check_machine(cfg)
    return cfg
