"""The rules that need the model: whether train.param_groups gives Muon a tensor that is not a matrix,
and whether lora.targets = re:PATTERN selects any linear layer. Both depend on the parameters'
names, kinds and shapes, which only the families' classes say; the model is built on the meta
device (no memory), and only when a config asks for Muon or for a pattern."""

from __future__ import annotations

from fivefold.config import Config
from fivefold.config.lora import parse_targets
from fivefold.config.validate_optimizer import runs_muon


def check_param_groups(cfg: Config) -> None:
    """One sentence if a group gives Muon a vector (models/param_settings.py)."""
    t = cfg.train
    if not runs_muon(t.optimizer, t.param_groups):
        return
    # The verdict depends on the model and the optimizer keys only, not on the layout: the planner's
    # search validates many layouts of one model (a meta model of qwen3-30b-a3b: ~7 s).
    key = (repr(cfg.model), t.optimizer, t.param_groups, t.weight_decay)
    if key in _GROUPS_CHECKED:
        return
    from fivefold.models import build_meta_model
    from fivefold.models.param_settings import settings_by_name

    settings_by_name(t, build_meta_model(cfg.model))
    _GROUPS_CHECKED.add(key)


_GROUPS_CHECKED: set[tuple] = set()  # (model, optimizer keys) whose groups passed check_param_groups


def check_lora_targets(cfg: Config) -> None:
    """One sentence if lora.targets' pattern selects no linear layer (models/lora.py says so while
    it builds the adapters)."""
    if cfg.lora.rank and parse_targets(cfg.lora.targets).pattern:
        from fivefold.models import build_meta_model

        build_meta_model(cfg.model, cfg.lora)
