"""gpt-oss's model: models/decoder.py's Transformer, whose attention takes its biases, sinks and
per-layer sliding window from the config, with YaRN RoPE over the whole head (the frequencies and
cos/sin factor of models/deepseek_v3/rope.py, the ramp's ends not rounded) rotating half-split
channels as the decoder does. The MoE layers are models/moe/layer.py's with a router bias, expert biases
and the clamped SwiGLU (moe.router_bias, projection_bias, activation)."""

from __future__ import annotations

import torch

from fivefold.config import ModelConfig
from fivefold.models.decoder import Transformer
from fivefold.models.deepseek_v3.rope import rope_attention_factor, yarn_frequencies


class GptOssTransformer(Transformer):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.rope_factor = rope_attention_factor(cfg)

    def rope_frequencies(self) -> torch.Tensor:
        return yarn_frequencies(self.cfg, self.cfg.head_dim)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super().rope_tables(positions)
        if self.rope_factor != 1.0:  # YaRN's attention factor
            cos, sin = cos * self.rope_factor, sin * self.rope_factor
        return cos, sin
