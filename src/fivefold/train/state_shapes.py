"""The whole shapes a checkpoint of a model must hold, and one sentence for the first tensor that
is missing or of another shape (a checkpoint of another model, or a partial one)."""

from __future__ import annotations

from fivefold.config import ConfigError


def expected_shapes(model) -> dict[str, tuple]:
    """Whole-tensor shapes a checkpoint of this single-device model holds (meta model is fine);
    a tied copy is saved once, as its source."""
    from fivefold.models.registry import model_spec

    tied = model_spec(model.cfg).tied(model.cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in tied}


def check_shapes(path, stored: dict[str, tuple], expected: dict[str, tuple], what: str) -> None:
    """One sentence naming the first missing or mismatched tensor (every rank raises the same).
    Keys are checkpoint keys: 'model/<name>' or '<moment>/<name>'."""
    for key, shape in expected.items():
        label = key.removeprefix("model/")
        if key not in stored:
            raise ConfigError(f"checkpoint {path} has no {what} tensor '{label}'; it is partial or was "
                              "written for another model")
        got = tuple(stored[key])
        if got != tuple(shape):
            raise ConfigError(f"checkpoint {path}: tensor '{label}' has shape {list(got)} but this "
                              f"model expects {list(shape)}; the checkpoint was written for a model of "
                              "another shape (compare the [model] settings)")
