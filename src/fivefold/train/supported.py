"""Training-only refusals: what the config language has but the trainer does not do yet, or this
machine cannot run (parallel.backend). `validate()` (fivefold.config) checks a config anywhere;
these need the family's ModelSpec and torch (or a CUDA device: log.memory_snapshot), so they sit above the models, before any process group.
"""

from __future__ import annotations

import torch

from fivefold.config import Config, ConfigError
from fivefold.config.validate import check_backend
from fivefold.models.registry import model_spec


def check_supported(cfg: Config) -> None:
    """The planner evaluates these layouts; the trainer refuses them instead of ignoring them."""
    p, m = cfg.parallel, cfg.model
    spec = model_spec(m)
    if m.mtp_depth and not spec.multi_token_prediction:
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} needs a family with multi-token prediction "
                          f"(deepseek_v3); model.family={m.family} has none, so set model.mtp_depth = 0")
    spec.check(m)
    check_backend(p.backend, torch.cuda.is_available())
    if cfg.log.memory_snapshot and not torch.cuda.is_available():
        raise ConfigError("log.memory_snapshot records the CUDA allocator's history, and this machine has no "
                          "CUDA device; unset log.memory_snapshot (log.profile_steps traces CPU runs too)")
