"""Names of the training state, layout-independent: single-device parameter names on every rank,
the persistent buffers saved with the model, and the whole shapes a checkpoint must hold.
Where each rank's pieces lie inside the whole tensors is parallel/shards.py."""

from __future__ import annotations

import torch
from torch import nn

from fivefold.config import ConfigError

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def named_params(par) -> dict[str, nn.Parameter]:
    """Single-device name -> this rank's parameter (each part's names are the model's names)."""
    return {name: p for part in par.parts for name, p in part.named_parameters()}


def module_persistent_buffers(part: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers of one module saved with the model (MoE bias-balancing state); RoPE tables are
    recomputed."""
    out = {}
    for mod_name, module in part.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{mod_name}.{name}" if mod_name else name] = buf
    return out


def persistent_buffers(par) -> dict[str, torch.Tensor]:
    """Persistent buffers of every part this rank runs."""
    return {name: buf for part in par.parts for name, buf in module_persistent_buffers(part).items()}


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
