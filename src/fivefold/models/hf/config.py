"""config.json <-> ModelConfig for the keys every decoder family shares (sizes, heads, RoPE, norms,
embeddings); each family's hf.py adds its own keys (experts) and refusals.

Anything our model cannot express is refused with one sentence, never dropped silently.
"""

from __future__ import annotations

from fivefold.config import ConfigError


def refuse(message: str):
    raise ConfigError(f"config.json {message}")


def positive_int(hf: dict, key: str) -> int:
    if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool) or hf[key] <= 0:
        refuse(f"needs a positive integer {key}, got {hf.get(key)!r}")
    return hf[key]


def _rope_from_hf(hf: dict, default_theta: float) -> dict:
    # transformers 5 writes `rope_parameters` (with rope_theta inside); older files write
    # `rope_theta` and `rope_scaling` at the top level (and very old ones say `type`, not `rope_type`).
    # Where a file has both, the precedence is transformers 5's: rope_scaling over rope_parameters,
    # and a rope_theta inside them over the top-level one.
    rope = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    theta = rope.get("rope_theta", hf.get("rope_theta", default_theta))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        refuse("sets partial_rotary_factor; fivefold rotates the whole head")
    out: dict = dict(rope_theta=float(theta))
    if rope_type == "llama3":
        needed = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if any(key not in rope for key in needed):
            refuse(f"uses rope_type 'llama3' but lacks some of {', '.join(needed)}")
        out.update(rope_scaling=float(rope["factor"]), rope_low_freq_factor=float(rope["low_freq_factor"]),
                   rope_high_freq_factor=float(rope["high_freq_factor"]),
                   rope_original_max_seq_len=int(rope["original_max_position_embeddings"]))
    elif rope_type != "default":
        refuse(f"uses rope_type '{rope_type}'; fivefold implements only the default and 'llama3' RoPE")
    return out


def decoder_keys_from_hf(hf: dict, gated_window: bool = False, default_theta: float = 10000.0) -> dict:
    """ModelConfig keyword arguments of the shared keys of a decoder's config.json.

    The family says how its transformers class reads what a file may leave out or switch off:
    `gated_window`, whether `sliding_window` applies only with `use_sliding_window` true (Qwen's
    classes; Mistral's and Mixtral's apply it whenever it is set), and `default_theta`, the RoPE
    theta of a file that names none.
    """
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        positive_int(hf, key)
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    if n_heads % n_kv_heads:
        refuse(f"has num_attention_heads={n_heads} and num_key_value_heads={n_kv_heads}; the kv heads "
               "must divide the heads")
    head_dim = hf.get("head_dim") or dim // n_heads
    if not hf.get("head_dim") and dim % n_heads:
        refuse(f"has hidden_size={dim} not divisible by num_attention_heads={n_heads} and no head_dim")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            refuse(f"sets {key}=true; fivefold's projections have no biases")
    if hf.get("hidden_act", "silu") != "silu":
        refuse(f"has hidden_act '{hf['hidden_act']}'; fivefold's feed-forward is SwiGLU (hidden_act 'silu')")
    if hf.get("attention_dropout", 0.0):
        refuse(f"sets attention_dropout={hf['attention_dropout']}; fivefold has no dropout, set it to 0")
    if gated_window:  # Qwen's files ship a sliding_window that use_sliding_window=false switches off
        if hf.get("use_sliding_window") and hf.get("sliding_window"):
            refuse(f"sets use_sliding_window=true with sliding_window={hf['sliding_window']}; fivefold's "
                   "attention is full causal, set use_sliding_window to false")
    elif hf.get("sliding_window"):
        refuse(f"sets sliding_window={hf['sliding_window']}; fivefold's attention is full causal, set it to null")
    return dict(dim=dim, n_layers=hf["num_hidden_layers"], n_heads=n_heads, n_kv_heads=n_kv_heads,
                head_dim=head_dim, ffn_dim=hf["intermediate_size"], vocab_size=hf["vocab_size"],
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                max_seq_len=int(hf.get("max_position_embeddings", 2048)), **_rope_from_hf(hf, default_theta))


def decoder_hf_config(cfg, dtype, model_type: str, architecture: str) -> dict:
    """The shared keys of a decoder's config.json.

    RoPE is written the pre-5.0 way (top-level rope_theta and rope_scaling): transformers 5 still
    reads it, while older readers would silently ignore `rope_parameters` and use the wrong theta.
    """
    if cfg.mlp_activation != "swiglu":
        raise ConfigError(f"model.mlp_activation='{cfg.mlp_activation}' has no Hugging Face {architecture}: "
                          "its feed-forward is SwiGLU only; keep fivefold's checkpoint instead")
    rope_scaling = None
    if cfg.rope_scaling > 0:
        rope_scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling,
                        "low_freq_factor": cfg.rope_low_freq_factor,
                        "high_freq_factor": cfg.rope_high_freq_factor,
                        "original_max_position_embeddings": cfg.rope_original_max_seq_len}
    return {
        "architectures": [architecture], "model_type": model_type,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn_dim, "vocab_size": cfg.vocab_size,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings, "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta, "rope_scaling": rope_scaling,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def refuse_moe(cfg, family: str) -> None:
    """A dense family's export refuses an MoE config (its HF class has no experts)."""
    if cfg.moe.n_experts > 0:
        raise ConfigError(f"model.moe.n_experts={cfg.moe.n_experts} but model.family={family} is dense; "
                          "export an MoE model with its MoE family")
