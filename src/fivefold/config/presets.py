"""Model shapes by name. A preset fills the [model] keys; explicit keys override it.

Shapes are the published ones (Llama 3.x model cards, Mixtral, DeepSeek-V3, the Qwen3 and gpt-oss
config.json files). The DeepSeek-V3-style preset is the mixtral family with DeepSeek-V3's MoE part and GQA
attention; `deepseek-v3` is the real shape (family deepseek_v3: latent attention, YaRN, grouped
routing). A preset implies its `model.family` (models/registry.py).
"""

# Llama 3.1+ RoPE frequency scaling: (factor, low_freq_factor, high_freq_factor, original context).
_LLAMA31_ROPE = dict(rope_scaling=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                     rope_original_max_seq_len=8192)
_LLAMA32_ROPE = dict(_LLAMA31_ROPE, rope_scaling=32.0)

_QWEN3 = dict(family="qwen3", vocab_size=151936, head_dim=128, rope_theta=1e6, norm_eps=1e-6,
              max_seq_len=40960, rope_scaling=0.0)
_QWEN3_MOE = dict(_QWEN3, family="qwen3_moe")

# DeepSeek's YaRN: 40x the original 4096-token context (DeepSeek-V3's and V2-Lite's config.json).
_DEEPSEEK_YARN = dict(rope_yarn_factor=40.0, rope_original_max_seq_len=4096, rope_yarn_beta_fast=32.0,
                      rope_yarn_beta_slow=1.0, rope_theta=10000.0, rope_scaling=0.0, max_seq_len=163840)

_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=131072)

# gpt-oss (its config.json files; GptOssConfig's defaults): head_dim 64, 8 kv heads, a 128-token
# window in even layers (odd ones full), sinks, biases, YaRN x32 over 4096 positions (ramp ends not
# rounded), every layer MoE top-4 with a biased router, expert biases and the clamped SwiGLU.
_GPT_OSS = dict(family="gpt_oss", dim=2880, n_heads=64, n_kv_heads=8, head_dim=64, ffn_dim=2880, vocab_size=201088,
                tie_embeddings=False, norm_eps=1e-5, max_seq_len=131072, rope_theta=150000.0, rope_scaling=0.0,
                rope_yarn_factor=32.0, rope_original_max_seq_len=4096, rope_yarn_beta_fast=32.0,
                rope_yarn_beta_slow=1.0, rope_yarn_truncate=False, sliding_window=128, full_attention_every=2,
                attention_sinks=True, attention_bias=True)
# aux_loss_coeff 0.9: their config.json's router_aux_loss_coef (GptOssConfig's default is 0.001).
_GPT_OSS_MOE = dict(top_k=4, score="softmax", balance="aux_loss", aux_loss_coeff=0.9, norm_topk_prob=True,
                    router_bias=True, projection_bias=True, activation="clamped_swiglu", swiglu_alpha=1.702,
                    swiglu_limit=7.0)

PRESETS: dict[str, dict] = {
    # Small enough to learn bytes of real text in a couple of minutes on 2 CPU cores.
    "tiny": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=256,
                 tie_embeddings=True, rope_theta=10000.0, norm_eps=1e-5, max_seq_len=1024,
                 rope_scaling=0.0),
    # The tiny MoE used by the tests and demos of expert parallelism.
    "tiny-moe": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=256,
                     tie_embeddings=True, rope_theta=10000.0, norm_eps=1e-5, max_seq_len=1024,
                     rope_scaling=0.0,
                     moe=dict(n_experts=4, top_k=2, expert_ffn_dim=192)),
    "llama3-1b": dict(_LLAMA3, **_LLAMA32_ROPE, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                      ffn_dim=8192, tie_embeddings=True),
    "llama3-3b": dict(_LLAMA3, **_LLAMA32_ROPE, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8,
                      ffn_dim=8192, tie_embeddings=True),
    "llama3-8b": dict(_LLAMA3, **_LLAMA31_ROPE, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      ffn_dim=14336, tie_embeddings=False),
    "llama3-70b": dict(_LLAMA3, **_LLAMA31_ROPE, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                       ffn_dim=28672, tie_embeddings=False),
    "llama3-405b": dict(_LLAMA3, **_LLAMA31_ROPE, dim=16384, n_layers=126, n_heads=128,
                        n_kv_heads=8, ffn_dim=53248, tie_embeddings=False),
    "mixtral-8x7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                         vocab_size=32000, tie_embeddings=False, rope_theta=1e6, norm_eps=1e-5,
                         max_seq_len=32768, rope_scaling=0.0,
                         moe=dict(n_experts=8, top_k=2, expert_ffn_dim=14336, score="softmax")),
    "deepseek-v3-style": dict(dim=7168, n_layers=61, n_heads=128, n_kv_heads=8, ffn_dim=18432,
                              vocab_size=129280, tie_embeddings=False, rope_theta=10000.0,
                              norm_eps=1e-6, max_seq_len=4096, rope_scaling=0.0,
                              moe=dict(n_experts=256, top_k=8, n_shared_experts=1, first_dense=3,
                                       expert_ffn_dim=2048, score="sigmoid", balance="bias")),
    # DeepSeek-V3 (671B, 37B active, + 14B for its one multi-token-prediction block): latent attention
    # (q through a 1536 latent, k/v from a 512 one, 128+64 q/k head dims, 128 value), 3 dense layers,
    # then 256 routed experts top-8 within the best 4 of 8 groups, weights x2.5, and 1 shared expert.
    "deepseek-v3": dict(_DEEPSEEK_YARN, family="deepseek_v3", dim=7168, n_layers=61, n_heads=128, n_kv_heads=128,
                        mtp_depth=1,
                        ffn_dim=18432, vocab_size=129280, tie_embeddings=False, norm_eps=1e-6,
                        rope_yarn_mscale=1.0, rope_yarn_mscale_all_dim=1.0,
                        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128,
                        moe=dict(n_experts=256, top_k=8, n_shared_experts=1, first_dense=3, expert_ffn_dim=2048,
                                 score="sigmoid", balance="bias", norm_topk_prob=True, n_group=8, topk_group=4,
                                 routed_scaling_factor=2.5)),
    # DeepSeek-V2-Lite (16B, 2.4B active): direct q projection, softmax router with the auxiliary loss,
    # 64 experts top-6 unnormalised, 2 shared, the first layer dense. Trains here; Hugging Face export
    # refuses it (DeepseekV3ForCausalLM always scores with sigmoid).
    "deepseek-v2-lite": dict(_DEEPSEEK_YARN, family="deepseek_v3", dim=2048, n_layers=27, n_heads=16, n_kv_heads=16,
                             ffn_dim=10944, vocab_size=102400, tie_embeddings=False, norm_eps=1e-6,
                             rope_yarn_mscale=0.707, rope_yarn_mscale_all_dim=0.707,
                             q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                             v_head_dim=128,
                             moe=dict(n_experts=64, top_k=6, n_shared_experts=2, first_dense=1, expert_ffn_dim=1408,
                                      score="softmax", balance="aux_loss", aux_loss_coeff=0.001,
                                      norm_topk_prob=False)),
    # Qwen3: per-head q/k RMSNorm, head_dim 128 whatever dim/n_heads is.
    "qwen3-0.6b": dict(_QWEN3, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072,
                       tie_embeddings=True),
    "qwen3-8b": dict(_QWEN3, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288,
                     tie_embeddings=False),
    "qwen3-32b": dict(_QWEN3, dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_dim=25600,
                      tie_embeddings=False),
    # Qwen3-MoE: 128 fine-grained experts, top-8 renormalised, every layer MoE.
    "qwen3-30b-a3b": dict(_QWEN3_MOE, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=6144,
                          tie_embeddings=False,
                          moe=dict(n_experts=128, top_k=8, expert_ffn_dim=768, norm_topk_prob=True,
                                   aux_loss_coeff=0.001)),
    "qwen3-235b-a22b": dict(_QWEN3_MOE, dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_dim=12288,
                            tie_embeddings=False,
                            moe=dict(n_experts=128, top_k=8, expert_ffn_dim=1536, norm_topk_prob=True,
                                     aux_loss_coeff=0.001)),
    # Tiny Qwen3s for tests: head_dim 48 != dim/n_heads = 32 (q/k/v wider than the stream), untied;
    # the MoE one with 8 fine-grained experts and its first layer dense by list.
    "tiny-qwen3": dict(family="qwen3", dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=48,
                       ffn_dim=384, vocab_size=256, tie_embeddings=False, rope_theta=1e6, norm_eps=1e-6,
                       max_seq_len=1024, rope_scaling=0.0),
    "tiny-qwen3-moe": dict(family="qwen3_moe", dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=48,
                           ffn_dim=384, vocab_size=256, tie_embeddings=False, rope_theta=1e6, norm_eps=1e-6,
                           max_seq_len=1024, rope_scaling=0.0,
                           moe=dict(n_experts=8, top_k=2, expert_ffn_dim=64, norm_topk_prob=True,
                                    dense_layers="0", aux_loss_coeff=0.001)),
    # Tiny DeepSeek-V3 for tests: latent attention with a q latent, q/k head dim 16+8 != value 16 (and
    # != dim/n_heads), 8 experts top-2 within 1 of 2 groups, 1 shared, the first layer dense, and one
    # multi-token-prediction block. 4 heads: tp2, and cp2 ulysses on top, split them.
    "tiny-deepseek-v3": dict(family="deepseek_v3", dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=128,
                             mtp_depth=1, vocab_size=256, tie_embeddings=False, rope_theta=10000.0, norm_eps=1e-6,
                             max_seq_len=1024, rope_scaling=0.0,
                             q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                             v_head_dim=16,
                             moe=dict(n_experts=8, top_k=2, n_shared_experts=1, first_dense=1, expert_ffn_dim=32,
                                      score="sigmoid", balance="bias", norm_topk_prob=True, n_group=2,
                                      topk_group=1, routed_scaling_factor=2.5)),
    # gpt-oss: 21B (3.6B active) and 117B (5.1B active).
    "gpt-oss-20b": dict(_GPT_OSS, n_layers=24, moe=dict(_GPT_OSS_MOE, n_experts=32)),
    "gpt-oss-120b": dict(_GPT_OSS, n_layers=36, moe=dict(_GPT_OSS_MOE, n_experts=128)),
    # Tiny gpt-oss for tests: a 16-token window in layers 0 and 2 (1 and 3 full), sinks, biases,
    # head_dim 16 != dim/n_heads, 8 experts top-2 with gpt-oss's router and experts.
    "tiny-gpt-oss": dict(_GPT_OSS, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=32,
                         vocab_size=256, max_seq_len=1024, sliding_window=16,
                         moe=dict(_GPT_OSS_MOE, n_experts=8, top_k=2)),
}
