"""DeepSeek-V3's model: models/decoder.py's Transformer with multi-head latent attention (MLA) and
DeepSeek's RoPE (models/deepseek_v3/rope.py). The MoE layers are models/moe/layer.py's (sigmoid router,
bias balancing, group-limited routing, routed_scaling_factor, shared experts).

MLA (DeepSeek-V2, section 2.1): keys and values come from one kv_lora_rank latent per token (RMS
normalised), expanded per head by kv_b_proj into a qk_nope_head_dim key part and a v_head_dim
value; each key also gets a qk_rope_head_dim RoPE part computed once per token and shared by every
head (k_pe). Queries come through a q_lora_rank latent (q_a_proj, its norm, q_b_proj), or one
direct q_proj when q_lora_rank = 0. Parameter names are Hugging Face's, so the adapter is a table.

As in the decoder, nothing here knows about parallelism: head counts are read from tensors, the
softmax runs in the parameter-free `core` with its default scale (any other scale is folded into q
first), and the latent projections and norms are whole modules tensor parallelism can replicate.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fivefold.config import ModelConfig
from fivefold.models.decoder import CausalAttention, Transformer, in_compute_dtype
from fivefold.models.decoder import initial_values as decoder_initial_values
from fivefold.models.deepseek_v3.rope import (
    apply_interleaved_rope,
    rope_attention_factor,
    rope_frequencies,
    softmax_scale_factor,
)
from fivefold.models.init import Fill, seeded_normal
from fivefold.models.loss.weight import current_micro_batch_weight
from fivefold.models.mtp import AttachScaledLoss, MTPLayer, depth_loss
from fivefold.models.rms_norm import RMSNorm

# transformers' DeepseekV3Attention builds its latent norms with RMSNorm's default eps, whatever
# rms_norm_eps says (so do DeepSeek's own modeling files).
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        qk_width = cfg.n_heads * (self.nope + self.rope)
        if cfg.q_lora_rank:
            self.q_proj = None
            self.q_a_proj = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, qk_width, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.dim, qk_width, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        # One projection makes the kv latent and the shared RoPE key (rows: latent, then k_pe).
        self.kv_a_proj_with_mqa = nn.Linear(cfg.dim, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, cfg.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.v_dim, cfg.dim, bias=False)
        # The core divides by sqrt(q.shape[-1]); YaRN's mscale² (if any) goes into q beforehand.
        self.q_scale = softmax_scale_factor(cfg)
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(in_compute_dtype(self.q_a_layernorm(self.q_a_proj(x))))
        q = q.view(batch, seq, -1, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)

        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(in_compute_dtype(self.kv_a_layernorm(latent)))
        kv = kv.view(batch, seq, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)

        q_rope = apply_interleaved_rope(q_rope, cos, sin)
        k_rope = apply_interleaved_rope(k_rope.unsqueeze(1), cos, sin)  # one head, shared by all
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = self.core(q, k, v.contiguous(), documents)  # (batch, heads, seq, v_head_dim)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class DeepseekV3Transformer(Transformer):
    """tokens (batch, seq) -> logits; the decoder's skeleton with latent attention and DeepSeek RoPE,
    and `mtp_depth` multi-token-prediction blocks (models/mtp.py) as layers n_layers, n_layers+1...
    They embed with `mtp_embeddings`, the embedding matrix itself (tied: a pipeline's last stage
    holds its own copy, as it does of a tied output layer)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, attention=LatentAttention)
        self.rope_factor = rope_attention_factor(cfg)
        self.mtp_embeddings = None
        if cfg.mtp_depth:
            from fivefold.models.moe.layer import moe_feed_forward

            for index in range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth):
                self.layers[str(index)] = MTPLayer(cfg, moe_feed_forward(cfg, index), LatentAttention(cfg))
            self.mtp_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.mtp_embeddings.weight = self.tok_embeddings.weight

    def multi_token_prediction(self, loss, h, targets, cos, sin, documents) -> torch.Tensor:
        for k in range(1, self.cfg.mtp_depth + 1):
            layer = self.layers[str(self.cfg.n_layers + k - 1)]
            h, normed = layer(h, self.mtp_embeddings(targets[..., k - 1].clamp(min=0)), cos, sin, documents)
            depth = depth_loss(self.output, normed, targets[..., k])
            layer.record(depth)
            loss = AttachScaledLoss.apply(loss, depth, self.cfg.mtp_loss_weight / self.cfg.mtp_depth
                                          * current_micro_batch_weight())
        return loss

    def rope_frequencies(self) -> torch.Tensor:
        return rope_frequencies(self.cfg)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super().rope_tables(positions)
        if self.rope_factor != 1.0:  # YaRN's attention factor, on the RoPE channels only
            cos, sin = cos * self.rope_factor, sin * self.rope_factor
        return cos, sin


def initial_values(cfg: ModelConfig, seed: int) -> Fill:
    """The decoder's initialisation (norms 1, expert bias 0, N(0, 0.02)), with the residual-stream
    std for the attention output projection as for the decoder's `wo`."""
    base = decoder_initial_values(cfg, seed)
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layers)

    def fill(name: str, shape, offsets, sizes) -> torch.Tensor:
        if name.endswith("attention.o_proj.weight"):
            return seeded_normal(seed, name, shape, residual_std, offsets, sizes)
        return base(name, shape, offsets, sizes)
    return fill
