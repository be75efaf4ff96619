"""The model families by name, with the `model_type` their Hugging Face config.json says.

Validation and config.json reading need only these names; each family's code (its ModelSpec, its
Hugging Face adapter) lives in models/<family>/, and models/registry.py maps a name to that folder
(tests/test_imports.py checks that the two lists agree).
"""

HF_MODEL_TYPES: dict[str, str] = {  # model.family -> config.json's model_type
    "llama": "llama",  # Llama 3.x, dense
    "mixtral": "mixtral",  # the Llama block with an MoE feed-forward
    "qwen3": "qwen3",  # Qwen3 dense: per-head q/k RMSNorm, explicit head_dim
    "qwen3_moe": "qwen3_moe",  # Qwen3-MoE: fine-grained experts, dense layers by list
    "deepseek_v3": "deepseek_v3",  # DeepSeek-V3: latent attention, YaRN, grouped routing
    "gpt_oss": "gpt_oss",  # gpt-oss: sliding windows, attention sinks, biases, clamped SwiGLU experts
}
FAMILIES = tuple(HF_MODEL_TYPES)

# Model keys only some families implement: away from its default (config/schema.py), a key is
# refused in any other family (config/validate_attention.py), whose modules have no such part.
FAMILY_KEYS: dict[str, tuple[str, ...]] = {
    "mlp_activation": ("llama",),
    "rope_yarn_factor": ("deepseek_v3", "gpt_oss"),
    "rope_yarn_truncate": ("gpt_oss",),
    "sliding_window": ("gpt_oss",),
    "full_attention_every": ("gpt_oss",),
    "attention_sinks": ("gpt_oss",),
    "attention_bias": ("gpt_oss",),
    "moe.router_bias": ("gpt_oss",),
    "moe.projection_bias": ("gpt_oss",),
    "moe.activation": ("gpt_oss",),
}

# Llama 3.1's RoPE scaling (model.rope_scaling) exists in the Llama-block families; the YaRN
# families (deepseek_v3, gpt_oss: FAMILY_KEYS' rope_yarn_factor) scale RoPE their own way.
LLAMA3_ROPE_FAMILIES = ("llama", "mixtral", "qwen3", "qwen3_moe")

# train.qk_clip rescales the query and key projections (models/decoder.py Attention.qk_row_scales).
# Qwen3's per-head q/k RMSNorm undoes any such rescaling, and latent attention (DeepSeek-V3) splits
# its query and key into parts QK-clip would scale differently (not built): both are refused.
QK_CLIP_FAMILIES = ("llama", "mixtral", "gpt_oss")
