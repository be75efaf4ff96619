"""The planner's statistics of the deepseek_v3 family (pure arithmetic, no torch): the decoder's
ModelStats with the latent attention's parameters, and attention FLOPs over the q/k head dim for
the scores and v_head_dim for the values.

Per layer, attention holds: q (q_a_proj d·r_q, its norm r_q, q_b_proj r_q·H·(n+r); or q_proj
d·H·(n+r)), kv_a_proj_with_mqa d·(r_kv+r), its norm r_kv, kv_b_proj r_kv·H·(n+v), o_proj H·v·d;
H heads, n/r/v the nope/rope/value head dims. The router's expert_bias is a buffer, not counted.
"""

from __future__ import annotations

import dataclasses

from fivefold.models.decoder_stats import ModelStats, decoder_stats


def attention_params(cfg) -> int:
    d, h = cfg.dim, cfg.n_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
        q = d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * qk
    else:
        q = d * h * qk
    kv = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    kv += cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv + h * cfg.v_head_dim * d


def stats(cfg) -> ModelStats:
    # Keys and values are expanded per head (n_kv_heads = n_heads); head_dim is the q/k head dim.
    return dataclasses.replace(decoder_stats(cfg), attention_params=attention_params(cfg),
                               v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank,
                               kv_lora_rank=cfg.kv_lora_rank, rope_head_dim=cfg.qk_rope_head_dim)
