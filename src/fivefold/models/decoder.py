"""The decoder every family is made of (Llama 3, Mixtral, Qwen3, Qwen3-MoE, DeepSeek-V3, gpt-oss), as a
plain single-device module; a family picks its variant (models/<family>/spec.py): per-head q/k RMSNorm
(Qwen3), attention biases, sinks and per-layer sliding windows from the config (gpt-oss), an MoE
feed-forward in some layers (models/moe/layer.py), tied or untied embeddings, or its own
attention module and RoPE tables (DeepSeek-V3's latent attention: a subclass of `Transformer`
passing `attention` and overriding `rope_frequencies` / `rope_tables`).

Nothing here knows about parallelism. Two properties make the parallel code's job possible:
- Shapes are read from tensors, never from the config, inside forward (`view(b, s, -1, head_dim)`),
  so a tensor-parallel shard with fewer heads runs the same code.
- Attention's math lives in a parameter-free `core` submodule, so context parallelism can swap in
  ring attention; layers live in a ModuleDict so a pipeline stage can drop some and keep the names
  (and checkpoint keys) of the rest; `tok_embeddings`, `norm` and `output` may be None for the same
  reason.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import ModelConfig
from fivefold.models.attention.layout import attention_window
from fivefold.models.attention.documents import document_attention
from fivefold.models.init import Fill, constant, seeded_normal
from fivefold.models.loss.linear_cross_entropy import OutputLayer
from fivefold.models.attention.logit_max import head_logit_max
from fivefold.models.attention.masked import masked_attention
from fivefold.models.rms_norm import RMSNorm
from fivefold.models.swiglu import swiglu


def rope_inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies, with Llama 3.1's scaling of the long wavelengths when enabled."""
    head_dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if cfg.rope_scaling > 0:
        # Wavelengths longer than original_ctx/low_freq_factor are slowed by `factor`; shorter than
        # original_ctx/high_freq_factor are kept; in between, a smooth interpolation of the two.
        factor, low, high = cfg.rope_scaling, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        original = cfg.rope_original_max_seq_len
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - low) / (high - low)
        interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        is_medium = (wavelen <= original / low) & (wavelen >= original / high)
        inv_freq = torch.where(is_medium, interpolated, inv_freq)
    return inv_freq.float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); cos/sin: (batch or 1, seq, head_dim)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


class CausalAttention(nn.Module):
    """Causal softmax attention over (batch, heads, seq, head_dim); K/V may have fewer heads (GQA).
    With `documents` (batch, seq), each token's document id, no query sees another document. With
    a `window` a query sees at most that many keys, itself included; `sinks` (heads,) are logits
    that join each head's softmax denominator (models/attention/masked.py)."""

    def __init__(self, window: int = 0):
        super().__init__()
        self.window = window  # 0: every earlier key

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if self.window or sinks is not None:
            return masked_attention(q, k, v, self.window, documents, sinks)
        if documents is not None:
            return document_attention(q, k, v, documents)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=q.shape[1] != k.shape[1])

    def logit_max(self, q: torch.Tensor, k: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """(heads,): each head's largest logit over what forward(q, k, ...) lets it see."""
        positions = torch.arange(q.shape[2], device=q.device)
        return head_logit_max(q, k, positions, positions, self.window, documents, documents)

    def extra_repr(self) -> str:
        return f"window={self.window}" if self.window else ""


class HeadValues(nn.Module):
    """One learned value per attention head, (heads,): the sinks' logits. A module of its own so
    that tensor parallelism splits it by heads as it splits q (models/spec.py `TP.HEAD_VALUES`)."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))

    def forward(self) -> torch.Tensor:
        return self.weight


class Attention(nn.Module):
    """Grouped-query attention with RoPE. With `qk_norm` (Qwen3) each head's query and key are
    RMS-normalised over head_dim (one weight shared by all heads) before RoPE. gpt-oss's variants
    come from the config: `attention_bias` (q, k, v and output biases), `attention_sinks` (one sink
    logit per head) and the layer's sliding `window`."""

    def __init__(self, cfg: ModelConfig, qk_norm: bool = False, window: int = 0):
        super().__init__()
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=bias)
        self.q_norm = RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if qk_norm else None
        self.sinks = HeadValues(cfg.n_heads) if cfg.attention_sinks else None
        self.core = CausalAttention(window)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        # Only a core that knows sinks is given them (config/validate_attention.py refuses the others).
        out = self.core(q, k, v, documents) if self.sinks is None else self.core(q, k, v, documents, self.sinks())
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def qk_row_scales(self, gamma: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
        """QK-clip's rescaling (train.qk_clip): `gamma` (n_heads,) is each head's factor on its
        logits, min(1, τ / its max logit); returns each of wq's and wk's weights and biases with
        the factor of each of its rows (whole shapes). A key head is shared by its group of query
        heads, so it takes √(the group's smallest γ) and each query head γ / that: every head's
        logits scale by its own γ exactly (Kimi K2 splits γ as √γ·√γ, a group of one here)."""
        kv_heads = self.wk.weight.shape[0] // self.head_dim
        smallest = gamma.view(kv_heads, -1).amin(dim=1)
        key = smallest.sqrt()
        query = gamma / key.repeat_interleave(gamma.numel() // kv_heads)
        scales = {}
        for linear, per_head in ((self.wq, query), (self.wk, key)):
            rows = per_head.repeat_interleave(self.head_dim)
            scales[linear.weight] = rows
            if linear.bias is not None:
                scales[linear.bias] = rows
        return scales

    def attention_core(self) -> nn.Module:
        """The module that sees this layer's q and k (the context-parallel one under cp)."""
        return self.core


class FeedForward(nn.Module):
    """The dense feed-forward (model.mlp_activation): SwiGLU w2(silu(w1 x) * w3 x), or a two-matrix
    MLP w2(act(w1 x)) with GeLU (erf form) or squared ReLU."""

    def __init__(self, dim: int, hidden: int, activation: str = "swiglu"):
        super().__init__()
        self.activation = activation
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        if activation == "swiglu":
            self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            return self.w2(swiglu(self.w1(x), self.w3(x)))
        up = self.w1(x)
        return self.w2(F.gelu(up) if self.activation == "gelu" else torch.square(F.relu(up)))


def in_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """A norm's output as the matmuls after it will read it. Under autocast each matmul would cast
    it itself and keep its own copy for backward (three for q, k, v; two for gate, up); one cast
    here keeps one, and a tensor-parallel gather of it then moves half the bytes."""
    if torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, feed_forward: nn.Module | None = None, qk_norm: bool = False,
                 attention: nn.Module | None = None):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        # Any module (x, cos, sin) -> x whose math runs in a parameter-free `core` (q, k, v) -> out.
        self.attention = attention if attention is not None else Attention(cfg, qk_norm)
        self.ffn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = (feed_forward if feed_forward is not None
                             else FeedForward(cfg.dim, cfg.ffn_dim, cfg.mlp_activation))

    # The block's residual branches, by method name: selective recomputation checkpoints each one
    # on its own (parallel/recompute.py), so that recomputing a branch in backward can stop before
    # its output projection and nothing needs that projection's output kept.
    residual_branches = ("attention_branch", "feed_forward_branch")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention_branch(x, cos, sin, documents)
        return x + self.feed_forward_branch(x)

    def attention_branch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         documents: torch.Tensor | None = None) -> torch.Tensor:
        return self.attention(in_compute_dtype(self.attention_norm(x)), cos, sin, documents)

    def feed_forward_branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(in_compute_dtype(self.ffn_norm(x)))


class Transformer(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab), or with targets the summed cross-entropy.

    `attention(cfg)`, when given, makes each block's attention module instead of `Attention`."""

    def __init__(self, cfg: ModelConfig, qk_norm: bool = False,
                 attention: Callable[[ModelConfig], nn.Module] | None = None):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        from fivefold.models.moe.layer import moe_feed_forward  # here: moe.py builds on this module

        self.layers = nn.ModuleDict({
            str(i): TransformerBlock(cfg, moe_feed_forward(cfg, i), qk_norm,
                                     attention(cfg) if attention is not None
                                     else Attention(cfg, qk_norm, attention_window(cfg, i)))
            for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = OutputLayer(cfg.dim, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("inv_freq", self.rope_frequencies(), persistent=False)

    def rope_frequencies(self) -> torch.Tensor:
        """The RoPE inverse frequencies of the config (a family with other RoPE overrides this)."""
        return rope_inverse_frequencies(self.cfg)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[..., None] * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The logits (batch, seq, vocab); given `targets`, the summed cross-entropy instead.

        `tokens` are ids, or hidden states when an earlier part of the model ran elsewhere.
        `positions` (batch or 1, seq) defaults to 0..seq-1; a shard of a sequence passes its own.
        `documents` (batch, seq), each token's document id, keeps attention inside documents
        (models/attention/documents.py); RoPE positions restarting per document come in `positions`.
        `targets` (batch, seq): each position's next token, IGNORE where it has none; the model then
        returns the sum of the cross-entropies over the positions with a target, an fp32 scalar,
        without making the logits (models/loss/linear_cross_entropy.py). (batch, seq, 1 + mtp_depth):
        the tokens ahead of each position too, column 0 the next one, for a family with multi-token
        prediction (models/mtp.py), whose loss then reaches backward with the returned one; in
        evaluation no MTP block runs.
        """
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        if positions.dim() == 1:
            positions = positions[None]  # (batch or 1, seq)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = self.rope_tables(positions)
        for name, layer in self.layers.items():
            if int(name) < self.cfg.n_layers:  # blocks past them belong to multi-token prediction
                h = layer(h, cos, sin, documents)
        if self.output is None:
            return h
        normed = in_compute_dtype(self.norm(h))
        if targets is None:
            return self.output(normed)
        loss = self.output(normed, targets[..., 0] if targets.dim() == 3 else targets)
        if targets.dim() == 3 and torch.is_grad_enabled():
            loss = self.multi_token_prediction(loss, h, targets, cos, sin, documents)
        return loss

    def multi_token_prediction(self, loss, h, targets, cos, sin, documents) -> torch.Tensor:
        """The LM loss, carrying the multi-token-prediction loss into backward (models/mtp.py);
        a family without it returns it as it is."""
        return loss

    def reset_computed_buffers(self) -> None:
        """Recompute the buffers derived from the config (RoPE frequencies), e.g. after the model was
        built on the meta device and moved to real memory uninitialised."""
        device = self.inv_freq.device
        self.inv_freq = self.rope_frequencies().to(device)


# The tied pair of `tie_embeddings`: the output layer's weight is the embedding matrix (copy -> source).
TIED = {"output.weight": "tok_embeddings.weight"}

# Tensors that start at zero: bias balancing's state, every bias (gpt-oss's projections, router and
# experts) and the attention sinks' logits.
ZERO_AT_START = ("expert_bias", ".bias", "sinks.weight", "experts.b1", "experts.b2", "experts.b3")


def initial_values(cfg: ModelConfig, seed: int) -> Fill:
    """fill(name, whole shape, offsets, sizes): any box of any initial parameter or persistent buffer
    (models/init.py), so each rank of a layout computes just the pieces it holds."""
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2 style: keeps the residual stream's scale

    def fill(name: str, shape, offsets, sizes) -> torch.Tensor:
        if cfg.tie_embeddings and name in TIED:
            name = TIED[name]  # a pipeline's last stage holds its own copy
        if "norm" in name:
            return constant(1.0, sizes)
        if name.endswith(ZERO_AT_START):
            return constant(0.0, sizes)
        std = residual_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else 0.02
        return seeded_normal(seed, name, shape, std, offsets, sizes)
    return fill
