"""Plain single-device models. Nothing in this package imports parallel/, train/ or plan/."""

from fivefold.config import ModelConfig
from fivefold.models.llama import Transformer


def build_model(cfg: ModelConfig, seed: int) -> Transformer:
    """The model of this config with its seed's initial weights, on the CPU."""
    model = Transformer(cfg)
    model.init_weights(seed)
    return model


__all__ = ["Transformer", "build_model"]
