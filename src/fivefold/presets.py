"""Model shapes by name. A preset fills the [model] keys; explicit keys override it.

Shapes are the published ones (Llama 3.x model cards, Mixtral, DeepSeek-V3). fivefold has no
multi-head latent attention, so the DeepSeek-V3-style preset keeps its MoE part and uses GQA.
"""

# Llama 3.1+ RoPE frequency scaling: (factor, low_freq_factor, high_freq_factor, original context).
_LLAMA31_ROPE = dict(rope_scaling=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                     rope_original_max_seq_len=8192)
_LLAMA32_ROPE = dict(_LLAMA31_ROPE, rope_scaling=32.0)

_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=131072)

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
}
