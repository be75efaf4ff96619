"""Each parameter's optimizer settings (train.optimizer, train.weight_decay, train.param_groups):
the groups are parsed in config/param_groups.py without a model; which parameter they select
depends on its kind (models/param_kinds.py) and its shape, which only the model says (a
meta-device model is enough)."""

from __future__ import annotations

from dataclasses import replace

from fivefold.config.param_groups import GroupSettings, parse, refuse
from fivefold.models.param_kinds import BLOCK_MATRIX_KINDS, param_kinds


def settings_by_name(train, model) -> dict[str, GroupSettings]:
    """Single-device parameter name -> its settings, for every name of every parameter of `model`
    (a meta-device model is enough). `train`: the [train] section."""
    groups = parse(train.param_groups)
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name, kind in param_kinds(model).items():
        param = params[name]
        muon = train.optimizer == "muon" and kind in BLOCK_MATRIX_KINDS and param.dim() >= 2
        settings = GroupSettings(1.0, train.weight_decay, "muon" if muon else "adamw")
        for group in groups:
            if group.selects(name, kind):
                settings = replace(settings, **dict(group.keys))
        if settings.optimizer == "muon" and param.dim() < 2:
            refuse(train.param_groups, f"it gives {name} (a {param.dim()}-D {kind} tensor) optimizer=muon, "
                                       "but Muon updates matrices only; narrow that group's selector")
        out[name] = settings
    return out
