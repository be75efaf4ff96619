"""Hugging Face MixtralForCausalLM <-> fivefold's mixtral family.

Hugging Face files keep one matrix per expert (`experts.{expert}.w1.weight`), fivefold one stacked
(experts, out, in) tensor per layer.
"""

from fivefold.config import ConfigError, ModelConfig, MoEConfig
from fivefold.config.families import HF_MODEL_TYPES
from fivefold.models.hf.adapter import HFAdapter
from fivefold.models.hf.config import decoder_hf_config, decoder_keys_from_hf, positive_int, refuse
from fivefold.models.llama.hf import ATTENTION_NAMES

_MOE = "model.layers.{layer}.block_sparse_moe"


def read_config(hf: dict) -> ModelConfig:
    for key in ("num_local_experts", "num_experts_per_tok"):
        positive_int(hf, key)
    # Mixtral: softmax router, top-k renormalised, every layer MoE, experts as wide as intermediate_size.
    moe = MoEConfig(n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                    expert_ffn_dim=hf["intermediate_size"], score="softmax", balance="aux_loss",
                    aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.01)))
    if hf.get("router_jitter_noise"):
        refuse(f"sets router_jitter_noise={hf['router_jitter_noise']}; fivefold's router is deterministic, set it to 0")
    if moe.top_k == 1:  # models/moe/layer.py renormalises only when top_k > 1 (Switch's top-1 keeps the probability)
        refuse("sets num_experts_per_tok=1, which Mixtral weights by 1 after renormalising, while fivefold "
               "weights a single expert by its router probability")
    # MixtralConfig's default theta is 1e6, not the usual 1e4.
    return ModelConfig(family="mixtral", moe=moe, **decoder_keys_from_hf(hf, default_theta=1e6))


def write_config(cfg: ModelConfig, dtype) -> dict:
    m = cfg.moe
    mixtral = (m.score == "softmax" and m.balance != "bias" and m.n_shared_experts == 0 and m.every == 1
               and m.first_dense == 0 and not m.dense_layers and m.norm_topk_prob and m.top_k > 1
               and (m.expert_ffn_dim or cfg.ffn_dim) == cfg.ffn_dim and m.capacity_factor == 0
               and m.n_group == 1 and m.routed_scaling_factor == 1.0 and cfg.rope_scaling == 0)
    if not mixtral:
        raise ConfigError(f"model.moe (n_experts={m.n_experts}) is not Mixtral-shaped: Hugging Face export "
                          "covers dense Llama models and Mixtral (softmax router, top_k > 1 renormalised, no "
                          "bias balancing, no shared experts, no group-limited routing or routed scaling, "
                          "every layer MoE, expert_ffn_dim = ffn_dim, dropless)")
    out = decoder_hf_config(cfg, dtype, "mixtral", "MixtralForCausalLM")
    out.update(num_local_experts=m.n_experts, num_experts_per_tok=m.top_k, router_aux_loss_coef=m.aux_loss_coeff,
               sliding_window=None, router_jitter_noise=0.0, output_router_logits=False)
    for key in ("rope_scaling", "mlp_bias", "attention_bias"):
        del out[key]
    return out


ADAPTER = HFAdapter(
    model_type=HF_MODEL_TYPES["mixtral"],
    names=ATTENTION_NAMES + [(f"{_MOE}.gate.weight", "layers.{layer}.feed_forward.router.gate.weight")],
    experts=[(f"{_MOE}.experts.{{expert}}.w1.weight", "layers.{layer}.feed_forward.experts.w1"),
             (f"{_MOE}.experts.{{expert}}.w2.weight", "layers.{layer}.feed_forward.experts.w2"),
             (f"{_MOE}.experts.{{expert}}.w3.weight", "layers.{layer}.feed_forward.experts.w3")],
    read_config=read_config, write_config=write_config)
