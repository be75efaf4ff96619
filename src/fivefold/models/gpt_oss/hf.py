"""Hugging Face GptOssForCausalLM <-> fivefold's gpt_oss family.

transformers holds and saves a layer's experts stacked: `mlp.experts.gate_up_proj` (experts,
hidden, 2·expert_ffn) with gate and up interleaved along the last dimension (gate at even
columns), its bias `gate_up_proj_bias` (experts, 2·expert_ffn) likewise, and `down_proj` (experts,
expert_ffn, hidden), all (in, out) where ours are (out, in) like nn.Linear: the adapter's `parts`
read each of our w1/w3/b1/b3 as a strided part of the fused tensor, w2 transposed, and join them
back when writing. The sinks are `self_attn.sinks`, the router `mlp.router.{weight,bias}`.

Keys a file leaves out mean what GptOssConfig says (its defaults are gpt-oss-120b's; its RoPE is
YaRN with factor 32 over 4096 positions, the ramp's ends not rounded). `layer_types` becomes
model.sliding_window and model.full_attention_every; patterns those cannot say are refused. The
released checkpoints store the experts' gate_up_proj and down_proj in MXFP4 (`quant_method
"mxfp4"`): they read dequantised (models/hf/mxfp4.py, exact in bf16 and fp32); other quantisations are
refused. Export writes unquantised weights.
"""

from __future__ import annotations

from fivefold.config import ConfigError, ModelConfig, MoEConfig
from fivefold.config.families import HF_MODEL_TYPES
from fivefold.models.attention.layout import attention_window
from fivefold.models.hf.adapter import HFAdapter, Part
from fivefold.models.hf.config import decoder_hf_config, decoder_keys_from_hf, positive_int, refuse
from fivefold.models.llama.hf import FRAME_NAMES
from fivefold.models.moe.layout import is_moe_layer

# GptOssConfig's defaults (transformers 5).
DEFAULTS = dict(num_hidden_layers=36, num_local_experts=128, vocab_size=201088, hidden_size=2880,
                intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
                sliding_window=128, tie_word_embeddings=False, max_position_embeddings=131072, rms_norm_eps=1e-5,
                attention_dropout=0.0, num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0,
                router_aux_loss_coef=0.001, attention_bias=True)
DEFAULT_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096)
DEFAULT_THETA = 150000.0

_ATTN = "model.layers.{layer}.self_attn"
_MLP = "model.layers.{layer}.mlp"
_OURS = "layers.{layer}.attention"
_EXPERTS = "layers.{layer}.feed_forward.experts"
NAMES = [
    *FRAME_NAMES,
    *[(f"{_ATTN}.{theirs}_proj.{kind}", f"{_OURS}.w{ours}.{kind}") for theirs, ours in
      (("q", "q"), ("k", "k"), ("v", "v"), ("o", "o")) for kind in ("weight", "bias")],
    (f"{_ATTN}.sinks", f"{_OURS}.sinks.weight"),
    (f"{_MLP}.router.weight", "layers.{layer}.feed_forward.router.gate.weight"),
    (f"{_MLP}.router.bias", "layers.{layer}.feed_forward.router.gate.bias"),
    (f"{_MLP}.experts.down_proj_bias", f"{_EXPERTS}.b2"),
]
PARTS = [
    (f"{_MLP}.experts.gate_up_proj", f"{_EXPERTS}.w1", Part(dim=-1, start=0, step=2, transposed=True)),
    (f"{_MLP}.experts.gate_up_proj", f"{_EXPERTS}.w3", Part(dim=-1, start=1, step=2, transposed=True)),
    (f"{_MLP}.experts.gate_up_proj_bias", f"{_EXPERTS}.b1", Part(dim=-1, start=0, step=2)),
    (f"{_MLP}.experts.gate_up_proj_bias", f"{_EXPERTS}.b3", Part(dim=-1, start=1, step=2)),
    (f"{_MLP}.experts.down_proj", f"{_EXPERTS}.w2", Part(transposed=True)),
]


def _number(hf: dict, key: str) -> float:
    value = hf[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        refuse(f"needs a positive number {key}, got {value!r}")
    return float(value)


def _windows(hf: dict, n_layers: int) -> dict:
    """layer_types and sliding_window -> model.sliding_window and model.full_attention_every."""
    types = hf.get("layer_types")
    if types is None:  # GptOssConfig's: sliding, full, sliding, ...
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= {"sliding_attention",
                                                                                  "full_attention"}:
        refuse(f"needs layer_types as {n_layers} of 'sliding_attention' and 'full_attention', got {types!r}")
    full = [t == "full_attention" for t in types]
    if all(full):
        return dict(sliding_window=0, full_attention_every=0)
    window = hf["sliding_window"]
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        refuse(f"has sliding_attention layers and sliding_window={window!r}; give a positive sliding_window")
    every = full.index(True) + 1 if any(full) else 0
    if any(f != (every > 0 and (i + 1) % every == 0) for i, f in enumerate(full)):
        refuse(f"has layer_types {types}; fivefold's sliding-window layers are all layers but every N-th "
               "(layers N-1, 2N-1, ... full attention)")
    return dict(sliding_window=window, full_attention_every=every)


def _rope(hf: dict) -> dict:
    rope = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    rope = rope or dict(DEFAULT_ROPE)  # GptOssConfig's when the file names none
    theta = float(rope.get("rope_theta", hf.get("rope_theta", DEFAULT_THETA)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        refuse("sets partial_rotary_factor; fivefold rotates the whole head")
    if rope_type == "default":
        return dict(rope_theta=theta, rope_scaling=0.0)
    if rope_type != "yarn":
        refuse(f"uses rope_type '{rope_type}'; fivefold's gpt_oss implements the default and 'yarn' RoPE")
    if rope.get("factor") is None:
        refuse("uses rope_type 'yarn' without a factor; give rope_parameters a factor")
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if rope.get(key):
            refuse(f"sets the YaRN {key}; fivefold's gpt_oss derives the attention factor from factor alone, "
                   f"as gpt-oss does, so leave {key} out")
    original = rope.get("original_max_position_embeddings", hf["max_position_embeddings"])
    return dict(rope_theta=theta, rope_scaling=0.0, rope_yarn_factor=float(rope["factor"]),
                rope_original_max_seq_len=int(original), rope_yarn_beta_fast=float(rope.get("beta_fast") or 32),
                rope_yarn_beta_slow=float(rope.get("beta_slow") or 1),
                rope_yarn_truncate=bool(rope.get("truncate", True)))


def read_config(hf: dict) -> ModelConfig:
    quantized = hf.get("quantization_config")
    method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else quantized
    if quantized and method != "mxfp4":  # MXFP4 pairs read dequantised (models/hf/stream.py)
        refuse(f"has a quantization_config with quant_method '{method}'; fivefold reads unquantised and MXFP4 "
               "weights: dequantise the checkpoint (e.g. to bf16) first")
    hf = {**DEFAULTS, **hf}  # a null head_dim or num_key_value_heads: derived, as GptOssConfig does
    for key in ("num_local_experts", "num_experts_per_tok", "num_hidden_layers"):
        positive_int(hf, key)
    if hf["num_experts_per_tok"] == 1:  # gpt-oss's softmax over one chosen logit weighs it by 1
        refuse("sets num_experts_per_tok=1, which gpt-oss weights by 1, while fivefold weights a single "
               "expert by its router probability")
    if hf["attention_bias"] not in (True, False):
        refuse(f"needs attention_bias true or false, got {hf['attention_bias']!r}")
    plain = {k: v for k, v in hf.items() if k not in (
        "attention_bias", "sliding_window", "hidden_act", "rope_parameters", "rope_scaling", "rope_theta")}
    keys = {**decoder_keys_from_hf(plain), **_rope(hf)}  # hidden_act: gpt-oss's experts ignore it
    moe = MoEConfig(n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"], score="softmax",
                    balance="aux_loss", aux_loss_coeff=float(hf["router_aux_loss_coef"]), norm_topk_prob=True,
                    router_bias=True, projection_bias=True, activation="clamped_swiglu",
                    swiglu_alpha=_number(hf, "swiglu_alpha"), swiglu_limit=_number(hf, "swiglu_limit"))
    return ModelConfig(family="gpt_oss", moe=moe, attention_sinks=True, attention_bias=hf["attention_bias"],
                       **_windows(hf, keys["n_layers"]), **keys)


def write_config(cfg: ModelConfig, dtype) -> dict:
    m = cfg.moe
    shaped = (m.score == "softmax" and m.balance != "bias" and m.n_shared_experts == 0 and m.capacity_factor == 0
              and m.n_group == 1 and m.routed_scaling_factor == 1.0 and m.norm_topk_prob and m.top_k > 1
              and m.router_bias and m.projection_bias and m.activation == "clamped_swiglu"
              and cfg.attention_sinks and all(is_moe_layer(cfg, i) for i in range(cfg.n_layers)))
    if not shaped:
        raise ConfigError(f"model (n_experts={m.n_experts}) is not gpt-oss-shaped: Hugging Face export needs "
                          "attention sinks, every layer MoE with a biased softmax router renormalised over "
                          "top_k >= 2, expert biases and the clamped SwiGLU, and no shared experts, bias "
                          "balancing, group-limited routing, routed scaling or capacity")
    out = decoder_hf_config(cfg, dtype, "gpt_oss", "GptOssForCausalLM")
    del out["mlp_bias"]
    rope = {"rope_type": "default"}
    if cfg.rope_yarn_factor > 0:
        rope = {"rope_type": "yarn", "factor": cfg.rope_yarn_factor, "beta_fast": cfg.rope_yarn_beta_fast,
                "beta_slow": cfg.rope_yarn_beta_slow, "truncate": cfg.rope_yarn_truncate,
                "original_max_position_embeddings": cfg.rope_original_max_seq_len}
    # Both spellings: transformers 5 reads rope_parameters; a missing one would mean gpt-oss's YaRN.
    out.update(rope_scaling=rope, rope_parameters={**rope, "rope_theta": cfg.rope_theta},
               attention_bias=cfg.attention_bias,
               # transformers builds the sliding mask even with no sliding layer: a window as wide as the context
               sliding_window=cfg.sliding_window or cfg.max_seq_len,
               layer_types=["sliding_attention" if attention_window(cfg, i) else "full_attention"
                            for i in range(cfg.n_layers)],
               num_local_experts=m.n_experts, num_experts_per_tok=m.top_k, router_aux_loss_coef=m.aux_loss_coeff,
               swiglu_alpha=m.swiglu_alpha, swiglu_limit=m.swiglu_limit, output_router_logits=False)
    if (m.expert_ffn_dim or cfg.ffn_dim) != cfg.ffn_dim:  # gpt-oss's experts are intermediate_size wide
        out["intermediate_size"] = m.expert_ffn_dim
    return out


ADAPTER = HFAdapter(model_type=HF_MODEL_TYPES["gpt_oss"], names=NAMES, parts=PARTS, read_config=read_config,
                    write_config=write_config)
