"""Hugging Face interop: read a checkpoint folder of any registered family into our model, and write
one back.

A folder is `config.json` plus safetensors weights (one file, several, or several named by
`model.safetensors.index.json`). Only safetensors is read: a pickle file can run code on load.
config.json's `model_type` picks the family (models/registry.py); the family's adapter
(models/<family>/hf.py) translates names, expert layouts and config keys.

Weights stream (models/hf/stream.py): reading takes one box of one tensor at a time from the
safetensors files, writing one tensor at a time into transformers' sharded layout.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from fivefold.config import ConfigError, ModelConfig
from fivefold.config.families import HF_MODEL_TYPES
from fivefold.models.registry import family_of_hf_model_type, model_spec


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json (its family from `model_type`); anything our
    model cannot express is refused in one sentence."""
    model_type = hf.get("model_type", "llama")
    family = family_of_hf_model_type(model_type)
    if family is None:
        readable = ", ".join(f"'{kind}'" for kind in HF_MODEL_TYPES.values())
        raise ConfigError(f"config.json has model_type '{model_type}'; fivefold reads model_type {readable}")
    return model_spec(family).hf.read_config(hf)


def hf_config_from(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json of `cfg` for its family's Hugging Face class (refuses what it cannot express)."""
    return model_spec(cfg).hf.write_config(cfg, dtype)


DEFAULT_SHARD_BYTES = 5 * 10**9  # the Hub's usual shard ("5GB"); writing streams, so memory does not depend on it


def hf_box_reader(folder) -> tuple[ModelConfig, Callable[[str, tuple, tuple, tuple], torch.Tensor]]:
    """(ModelConfig, fill): `fill(name, whole_shape, offsets, sizes)` reads that box of fivefold's
    tensor `name` from a Hugging Face folder as fp32 (see models/hf/stream.py)."""
    from fivefold.models.hf.stream import hf_box_reader as reader

    return reader(folder)


def load_pretrained(path, dtype: torch.dtype | None = torch.float32) -> nn.Module:
    """Our model with the weights of a Hugging Face checkpoint folder.

    Weights are converted to `dtype` (fp32 by default, the trainer's master precision; None keeps
    the stored dtype). They are read tensor by tensor into a meta-device model, so the peak is the
    model plus one tensor (not random initial weights and then the loaded ones).
    """
    from fivefold.models.hf.stream import HFBoxes

    reader = HFBoxes(path, dtype)
    tensors = {}
    for name in reader.shapes:
        tensors[name] = reader.whole(name)
        reader.close()  # unmap: the pages just read would otherwise stay in this process's RSS
    return model_from_tensors(reader.cfg, tensors)


def model_from_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """The model of `cfg` around these whole tensors (a checkpoint's: a tied copy is absent), not copied."""
    spec = model_spec(cfg)
    with torch.device("meta"):
        model = spec.build(cfg)
    tied = spec.tied(cfg)
    tensors = {**tensors, **{copy: tensors[source] for copy, source in tied.items()}}
    model.load_state_dict(tensors, strict=True, assign=True)
    for copy, source in tied.items():  # assign=True gives each module its own Parameter; tie them again
        module, _, attr = copy.rpartition(".")
        setattr(model.get_submodule(module), attr, model.get_parameter(source))
    _materialize_buffers(model, cfg)
    return model


def _materialize_buffers(model: nn.Module, cfg: ModelConfig) -> None:
    """Non-persistent buffers (RoPE frequencies) are computed, not loaded: take them from a model of
    the same config with no layers and a one-token vocabulary, which costs nothing to build."""
    shell = model_spec(cfg).build(dataclasses.replace(cfg, n_layers=0, vocab_size=1, mtp_depth=0))
    for name, buffer in shell.named_buffers():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, buffer)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # a buffer inside a layer would need handling here
        raise RuntimeError(f"model_from_tensors left {left} unset; teach _materialize_buffers about it")


def save_hf(model: nn.Module, path, max_shard_bytes: int = DEFAULT_SHARD_BYTES):
    """Write `model` as a Hugging Face folder (config.json + safetensors shards, with an index when
    there are several, as transformers writes them); returns the folder."""
    from fivefold.models.hf.stream import write_hf_folder

    spec = model_spec(model.cfg)
    # What a whole model of this config has of the stage-end modules (some exist only with some keys).
    shell = spec.build(dataclasses.replace(model.cfg, n_layers=0, vocab_size=1))
    missing = [m for m in (*spec.first_stage, *spec.last_stage)
               if getattr(model, m) is None and getattr(shell, m) is not None]
    if missing:
        raise ValueError(f"save_hf needs the whole model, but this one has no {', '.join(missing)} "
                         "(a pipeline stage?)")
    state = model.state_dict()
    return write_hf_folder(path, model.cfg, {name: (tuple(t.shape), t.dtype) for name, t in state.items()},
                           lambda name: state[name].cpu(), max_shard_bytes)
