"""DeepSeek-V3's RoPE: YaRN frequencies over the qk_rope_head_dim channels, the cos/sin attention
factor, the softmax scale's mscale², and the rotation of interleaved channel pairs. gpt-oss uses the
same YaRN frequencies (over head_dim, ramp ends not rounded) and attention factor.

The formulas are YaRN's as transformers computes them for DeepSeek configs (`rope_type: "yarn"`):
- frequencies: channel pairs rotating fewer than `beta_slow` times over the original context are
  interpolated (divided by `factor`), those rotating more than `beta_fast` times kept, a linear ramp
  between (its ends floored/ceiled to whole pairs);
- cos and sin are multiplied by mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both
  are set, else by mscale(factor, 1), with mscale(s, m) = 0.1·m·ln(s) + 1 (1 for s <= 1);
- with `mscale_all_dim` set the softmax scale 1/sqrt(qk head dim) is multiplied by
  mscale(factor, mscale_all_dim)².
"""

from __future__ import annotations

import math

import torch

from fivefold.config import ModelConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the qk_rope_head_dim RoPE channels (YaRN when rope_yarn_factor > 0)."""
    return yarn_frequencies(cfg, cfg.qk_rope_head_dim)


def yarn_frequencies(cfg: ModelConfig, dim: int) -> torch.Tensor:
    """Inverse frequencies of `dim` RoPE channels, YaRN's when rope_yarn_factor > 0 (gpt-oss rotates
    all of head_dim). With rope_yarn_truncate false (gpt-oss) the ramp's ends stay fractional."""
    base = cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    factor = cfg.rope_yarn_factor
    if factor > 0:
        original = cfg.rope_original_max_seq_len

        def pair_rotating(turns: float) -> float:  # the (fractional) pair that turns `turns` times
            return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

        low, high = pair_rotating(cfg.rope_yarn_beta_fast), pair_rotating(cfg.rope_yarn_beta_slow)
        if cfg.rope_yarn_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # a ramp of width 0 would divide by zero
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        kept = 1 - ramp  # the share of each pair's original frequency
        inv_freq = inv_freq / factor * ramp + inv_freq * kept
    return inv_freq.float()


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by (1 without YaRN)."""
    factor = cfg.rope_yarn_factor
    if factor <= 0:
        return 1.0
    if cfg.rope_yarn_mscale and cfg.rope_yarn_mscale_all_dim:
        return yarn_mscale(factor, cfg.rope_yarn_mscale) / yarn_mscale(factor, cfg.rope_yarn_mscale_all_dim)
    return yarn_mscale(factor)


def softmax_scale_factor(cfg: ModelConfig) -> float:
    """The softmax scale over the default 1/sqrt(qk head dim): folded into q before the attention core."""
    if cfg.rope_yarn_factor > 0 and cfg.rope_yarn_mscale_all_dim:
        return yarn_mscale(cfg.rope_yarn_factor, cfg.rope_yarn_mscale_all_dim) ** 2
    return 1.0


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on channel pairs (0, 1), (2, 3), ... as DeepSeek's checkpoints lay them out, so their q/k
    rows load unpermuted (a streaming reader reads boxes of rows by name). The rotated pairs come out
    as (all first elements, all second elements): q and k both, so their dot products are those of the
    interleaved layout. x: (batch, heads, seq, d); cos/sin: (batch or 1, seq, d), pair i's angle at i
    and at d/2 + i (models/decoder.py's tables)."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)
    first, second = x[..., 0::2], x[..., 1::2]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(x.dtype)
