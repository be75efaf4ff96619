"""Hugging Face Qwen3ForCausalLM <-> fivefold's qwen3 family: the Llama names plus the per-head
q/k norms."""

from fivefold.config import ModelConfig
from fivefold.config.families import HF_MODEL_TYPES
from fivefold.models.hf.adapter import HFAdapter
from fivefold.models.hf.config import decoder_hf_config, decoder_keys_from_hf, refuse_moe
from fivefold.models.llama.hf import ATTENTION_NAMES, DENSE_MLP_NAMES

QK_NORM_NAMES = [
    ("model.layers.{layer}.self_attn.q_norm.weight", "layers.{layer}.attention.q_norm.weight"),
    ("model.layers.{layer}.self_attn.k_norm.weight", "layers.{layer}.attention.k_norm.weight"),
]


def read_config(hf: dict) -> ModelConfig:
    if "head_dim" not in hf:  # Qwen3Config's default, not hidden_size / num_attention_heads
        hf = {**hf, "head_dim": 128}
    return ModelConfig(family="qwen3", **decoder_keys_from_hf(hf, gated_window=True))


def write_config(cfg: ModelConfig, dtype) -> dict:
    refuse_moe(cfg, "qwen3")
    out = decoder_hf_config(cfg, dtype, "qwen3", "Qwen3ForCausalLM")
    out.update(use_sliding_window=False, sliding_window=None)
    del out["mlp_bias"]
    return out


ADAPTER = HFAdapter(model_type=HF_MODEL_TYPES["qwen3"], names=ATTENTION_NAMES + QK_NORM_NAMES + DENSE_MLP_NAMES,
                    read_config=read_config, write_config=write_config)
