"""Plain single-device models. Nothing in this package imports parallel/, train/ or plan/."""

import torch

from fivefold.config import ModelConfig
from fivefold.models.llama import Transformer, initial_values


def build_model(cfg: ModelConfig, seed: int) -> Transformer:
    """The model of this config with its seed's initial weights, on the CPU (single-device use:
    tests, conversion, inference; training builds on the meta device, see `build_meta_model`)."""
    model = Transformer(cfg)
    model.init_weights(seed)
    return model


def build_meta_model(cfg: ModelConfig) -> Transformer:
    """The model's structure without memory: parameters and buffers on the meta device. Training
    splits and shards it there, then each rank materialises only its own pieces
    (parallel/materialize.py) with `initial_values(cfg, seed)` or weights read from files."""
    with torch.device("meta"):
        return Transformer(cfg)


__all__ = ["Transformer", "build_meta_model", "build_model", "initial_values"]
