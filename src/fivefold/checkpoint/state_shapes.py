"""The whole shapes a checkpoint of a model (and of its optimizer's state) must hold, and one
sentence for the first tensor that is missing or of another shape (a checkpoint of another model,
or a partial one)."""

from __future__ import annotations

from fivefold.config import ConfigError


def expected_shapes(model) -> dict[str, tuple]:
    """Whole-tensor shapes a checkpoint of this single-device model holds (meta model is fine);
    a tied copy is saved once, as its source."""
    from fivefold.models.registry import model_spec

    tied = model_spec(model.cfg).tied(model.cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in tied}


def expected_tensors(cfg_model, with_optimizer: bool, train=None, lora=None) -> dict[str, tuple]:
    """Checkpoint key -> whole shape this model needs (from a meta-device model: no memory); with
    the optimizer, each parameter's state under `train` (the [train] section it was saved under).
    With `lora` (a [lora] section with a rank) the frozen base is not saved: only the adapters, with
    their optimizer state, and the persistent buffers."""
    from fivefold.models import build_meta_model
    from fivefold.models.lora.adapters import is_adapter
    from fivefold.checkpoint.resume_optimizer import STATE_KEYS, optimizers_by_name

    model = build_meta_model(cfg_model, lora)
    shapes = expected_shapes(model)
    if lora is not None and lora.rank:
        params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        shapes = {name: shape for name, shape in shapes.items() if is_adapter(name) or name not in params}
    out = {f"model/{name}": shape for name, shape in shapes.items()}
    if with_optimizer:
        optimizers = optimizers_by_name(train, cfg_model, lora)
        out.update({f"{key}/{name}": shape for name, shape in shapes.items() if name in optimizers
                    for key in STATE_KEYS[optimizers[name]]})
    return out


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
