"""Which layers attend through a sliding window: pure arithmetic on the config (the model, the
planner's statistics and the Hugging Face adapters use it without torch)."""

from __future__ import annotations

from fivefold.config import ModelConfig


def attention_window(cfg: ModelConfig, index: int) -> int:
    """The keys a query of layer `index` sees at most, itself included; 0 = every earlier key.
    With model.sliding_window set, every layer slides but each full_attention_every-th
    (layers N-1, 2N-1, ...: gpt-oss alternates, its layer 0 sliding)."""
    every = cfg.full_attention_every
    if not cfg.sliding_window or (every and (index + 1) % every == 0):
        return 0
    return cfg.sliding_window
