"""The planner's view of a model: its family's parameter counts and FLOPs (models/<family>/stats.py,
pure arithmetic on the config; see models/decoder_stats.py for what ModelStats holds)."""

from __future__ import annotations

from fivefold.models.decoder_stats import ModelStats
from fivefold.models.registry import family_stats


def model_stats(model) -> ModelStats:
    """ModelConfig -> ModelStats, by the config's model family."""
    return family_stats(model)


__all__ = ["ModelStats", "model_stats"]
