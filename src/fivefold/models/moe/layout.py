"""Which layers of a config are MoE layers: pure arithmetic on the config (the planner, the rank
map and validation use it without torch)."""

from __future__ import annotations

from fivefold.config import ModelConfig


def dense_layers(text: str) -> set[int]:
    """`model.moe.dense_layers` ("0,5") as a set of layer indices."""
    return {int(part) for part in text.split(",") if part.strip()}


def is_moe_layer(cfg: ModelConfig, index: int) -> bool:
    m = cfg.moe
    return (m.n_experts > 0 and index >= m.first_dense and (index - m.first_dense) % m.every == 0
            and index not in dense_layers(m.dense_layers))
