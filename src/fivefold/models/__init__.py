"""Plain single-device models, one folder per family with its ModelSpec (models/registry.py).
Nothing in this package imports parallel/, train/ or plan/.

This file imports nothing heavy: the planner reads family statistics through models/registry.py
without torch; the functions below import the family's code when called.
"""

from __future__ import annotations


def build_meta_model(cfg, lora=None):
    """The model's structure without memory: parameters and buffers on the meta device. Training
    splits and shards it there, then each rank materialises only its own pieces
    (parallel/materialize.py) with `initial_values(cfg, seed)` or weights read from files.
    `lora`: the [lora] section; with a rank, the adapters beside their layers (models/lora/adapters.py)."""
    import torch

    from fivefold.models.registry import model_spec

    with torch.device("meta"):
        model = model_spec(cfg).build(cfg)
    if lora is not None and lora.rank:
        from fivefold.models.lora.adapters import add_adapters

        add_adapters(model, lora)
    return model


def build_model(cfg, seed: int):
    """The model of this config with its seed's initial weights, on the CPU (single-device use:
    tests, conversion, inference; training builds on the meta device, see `build_meta_model`)."""
    from fivefold.models.init import fill_whole
    from fivefold.models.registry import model_spec

    model = model_spec(cfg).build(cfg)
    fill_whole(model, initial_values(cfg, seed))
    return model


def initial_values(cfg, seed: int):
    """fill(name, whole_shape, offsets, sizes) of the family's seeded initial weights. A tied copy
    (a pipeline's last stage holds its own) gets its source's values."""
    from fivefold.models.registry import model_spec

    spec = model_spec(cfg)
    fill, tied = spec.initial_values(cfg, seed), spec.tied(cfg)
    return lambda name, *box: fill(tied.get(name, name), *box)


__all__ = ["build_meta_model", "build_model", "initial_values"]
