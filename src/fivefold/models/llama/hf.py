"""Hugging Face LlamaForCausalLM <-> fivefold's llama family.

Our RoPE uses the rotate-half convention of Hugging Face's Llama, so the q/k projections are copied
as they are, without the head permutation that Meta's original checkpoints would need.
"""

from fivefold.config import ModelConfig
from fivefold.config.families import HF_MODEL_TYPES
from fivefold.models.hf.adapter import HFAdapter
from fivefold.models.hf.config import decoder_hf_config, decoder_keys_from_hf, refuse, refuse_moe

# (Hugging Face name, our name) of every decoder family; `{layer}` stands for a layer index. The
# frame (embedding, final norm, output layer, the two norms of each block) is every family's; the
# attention rows are those of the families with plain q/k/v/o projections.
FRAME_NAMES = [
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{layer}.input_layernorm.weight", "layers.{layer}.attention_norm.weight"),
    ("model.layers.{layer}.post_attention_layernorm.weight", "layers.{layer}.ffn_norm.weight"),
]
ATTENTION_NAMES = FRAME_NAMES + [
    ("model.layers.{layer}.self_attn.q_proj.weight", "layers.{layer}.attention.wq.weight"),
    ("model.layers.{layer}.self_attn.k_proj.weight", "layers.{layer}.attention.wk.weight"),
    ("model.layers.{layer}.self_attn.v_proj.weight", "layers.{layer}.attention.wv.weight"),
    ("model.layers.{layer}.self_attn.o_proj.weight", "layers.{layer}.attention.wo.weight"),
]
DENSE_MLP_NAMES = [
    ("model.layers.{layer}.mlp.gate_proj.weight", "layers.{layer}.feed_forward.w1.weight"),
    ("model.layers.{layer}.mlp.up_proj.weight", "layers.{layer}.feed_forward.w3.weight"),
    ("model.layers.{layer}.mlp.down_proj.weight", "layers.{layer}.feed_forward.w2.weight"),
]


def read_config(hf: dict) -> ModelConfig:
    if hf.get("model_type", "llama") != "llama":
        refuse(f"has model_type '{hf['model_type']}', not 'llama'")
    return ModelConfig(family="llama", **decoder_keys_from_hf(hf))


def write_config(cfg: ModelConfig, dtype) -> dict:
    refuse_moe(cfg, "llama")
    return decoder_hf_config(cfg, dtype, "llama", "LlamaForCausalLM")


ADAPTER = HFAdapter(model_type=HF_MODEL_TYPES["llama"], names=ATTENTION_NAMES + DENSE_MLP_NAMES,
                    read_config=read_config, write_config=write_config)
