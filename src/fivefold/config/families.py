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
}
FAMILIES = tuple(HF_MODEL_TYPES)
