"""Configuration, the bottom layer: it imports nothing of fivefold outside this folder, and no torch.

- schema.py: one dataclass per TOML section, each key with its default, its accepted values and the
  comment `fivefold train --help` shows; checks.py reads those declarations;
- load.py: TOML files, `--section.key value` overrides, presets (presets.py), shipped configs by
  name (shipped.py) and model.init_from (with a reader of config.json passed in);
- validate.py (+ validate_data.py): every rule across keys, checked before any process group exists;
The entry points that callers use, `load_config`, `config_from_dict` and `validate`, are one room
up, in fivefold.configure, which adds what needs the families' classes.
- schedules.py, families.py, manifest.py: the facts of other layers that validation needs.

Every problem is a `ConfigError` holding one sentence that names the key and the fix.
"""

from fivefold.config.errors import ConfigError
from fivefold.config.load import CliText, parse_overrides, to_toml
from fivefold.config.schema import (BACKENDS, CP_METHODS, PP_SCHEDULES, ZERO_STAGES, CheckpointConfig, ClusterConfig,
                                    Config, DataConfig, DebugConfig, LogConfig, LoraConfig, ModelConfig, MoEConfig, ParallelConfig,
                                    TrainConfig, micro_batches)

__all__ = ["BACKENDS", "CP_METHODS", "PP_SCHEDULES", "ZERO_STAGES", "CheckpointConfig", "CliText", "ClusterConfig",
           "Config", "ConfigError", "DataConfig", "DebugConfig", "LogConfig", "LoraConfig", "ModelConfig", "MoEConfig",
           "ParallelConfig", "TrainConfig", "micro_batches", "parse_overrides", "to_toml"]
