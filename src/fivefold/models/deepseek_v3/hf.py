"""Hugging Face DeepseekV3ForCausalLM <-> fivefold's deepseek_v3 family.

Our attention's parameters carry transformers' names, so the table is one row per tensor. The
router's `expert_bias` is transformers' `e_score_correction_bias` (DeepSeek-V3's aux-loss-free
balancing state), read and written like a weight. Experts are saved one matrix per expert, as for
Qwen3-MoE. RoPE rows load unpermuted: our attention rotates the interleaved channel pairs.

Keys a file leaves out mean what DeepseekV3Config says (its defaults are the 671B model's).

Multi-token prediction: DeepSeek's files hold its blocks as layers num_hidden_layers and up
(`num_nextn_predict_layers` of them), each with enorm, hnorm, eh_proj, shared_head.norm and copies
of the embedding and output matrices (embed_tokens, shared_head.head), which our blocks share with
the main model: we read the blocks and write all of it, copies included. transformers' class drops
those layers on load. A folder whose config.json counts such layers but whose weights hold none
(transformers writes none, and its config's default is 1) loads without multi-token prediction,
with a warning, as transformers loads it.
"""

from __future__ import annotations

import re

from fivefold.config import ConfigError, ModelConfig, MoEConfig
from fivefold.config.families import HF_MODEL_TYPES
from fivefold.models.hf.adapter import NOTHING, HFAdapter
from fivefold.models.hf.config import decoder_hf_config, decoder_keys_from_hf, positive_int, refuse
from fivefold.models.llama.hf import DENSE_MLP_NAMES, FRAME_NAMES

# DeepseekV3Config's defaults of the keys below (transformers 5).
DEFAULTS = dict(n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
                first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
                q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                rope_interleave=True, num_key_value_heads=128, max_position_embeddings=4096,
                num_nextn_predict_layers=1)

_ATTN = "model.layers.{layer}.self_attn"
_MLP = "model.layers.{layer}.mlp"
_OURS = "layers.{layer}.attention"
NAMES = [
    *FRAME_NAMES,
    *[(f"{_ATTN}.{m}.weight", f"{_OURS}.{m}.weight") for m in (
        "q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
        "o_proj")],
    *DENSE_MLP_NAMES,
    (f"{_MLP}.gate.weight", "layers.{layer}.feed_forward.router.gate.weight"),
    (f"{_MLP}.gate.e_score_correction_bias", "layers.{layer}.feed_forward.router.expert_bias"),
    (f"{_MLP}.shared_experts.gate_proj.weight", "layers.{layer}.feed_forward.shared.w1.weight"),
    (f"{_MLP}.shared_experts.down_proj.weight", "layers.{layer}.feed_forward.shared.w2.weight"),
    (f"{_MLP}.shared_experts.up_proj.weight", "layers.{layer}.feed_forward.shared.w3.weight"),
    # multi-token prediction's blocks (models/mtp.py)
    *[(f"model.layers.{{layer}}.{m}.weight", f"layers.{{layer}}.{m}.weight") for m in ("enorm", "hnorm", "eh_proj")],
    ("model.layers.{layer}.shared_head.norm.weight", "layers.{layer}.head_norm.weight"),
]
# What each multi-token-prediction layer of DeepSeek's files repeats of the main model's matrices.
MTP_COPIES = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}
EXPERTS = [(f"{_MLP}.experts.{{expert}}.gate_proj.weight", "layers.{layer}.feed_forward.experts.w1"),
           (f"{_MLP}.experts.{{expert}}.down_proj.weight", "layers.{layer}.feed_forward.experts.w2"),
           (f"{_MLP}.experts.{{expert}}.up_proj.weight", "layers.{layer}.feed_forward.experts.w3")]

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def dropped_on_read(name: str, cfg: ModelConfig) -> bool:
    """Multi-token-prediction layers past model.mtp_depth, and the main matrices' copies in those we read."""
    match = _LAYER.match(name)
    if match is None or int(match.group(1)) < cfg.n_layers:
        return False
    return int(match.group(1)) >= cfg.n_layers + cfg.mtp_depth or name[match.end():] in MTP_COPIES


def mtp_copies(cfg: ModelConfig) -> dict[str, str]:
    """Hugging Face name -> ours of the main matrices' copies each multi-token-prediction layer holds."""
    return {f"model.layers.{layer}.{theirs}": ours for layer in range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth)
            for theirs, ours in MTP_COPIES.items()}


def fit_to_files(cfg: ModelConfig, names: set[str]) -> ModelConfig:
    """Without multi-token prediction when the files hold none of its layers (see the module doc)."""
    if cfg.mtp_depth and not any(n.startswith(f"model.layers.{cfg.n_layers}.") for n in names):
        import dataclasses
        import warnings

        warnings.warn(f"config.json has num_nextn_predict_layers={cfg.mtp_depth} but the weights hold no "
                      f"multi-token-prediction layer (model.layers.{cfg.n_layers}.*): loading without it "
                      "(model.mtp_depth = 0), as transformers does", stacklevel=2)
        return dataclasses.replace(cfg, mtp_depth=0)
    return cfg


def _with_defaults(hf: dict) -> dict:
    out = {**DEFAULTS, **hf}
    if out["num_key_value_heads"] is None:  # DeepseekV3Config's reading of null
        out["num_key_value_heads"] = out.get("num_attention_heads")
    return out


def _yarn_from_hf(hf: dict) -> tuple[dict, dict]:
    """(config.json with the RoPE keys the shared reader understands, our YaRN keys)."""
    rope = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        refuse("uses rope_type 'llama3'; fivefold's deepseek_v3 implements the default and 'yarn' RoPE")
    if rope_type != "yarn":
        return hf, {}
    if rope.get("factor") is None:
        refuse("uses rope_type 'yarn' without a factor; give rope_parameters a factor")
    if rope.get("attention_factor") is not None:
        refuse("sets the YaRN attention_factor; fivefold derives it from factor, mscale and mscale_all_dim, "
               "so leave attention_factor out")
    if rope.get("truncate", True) is False:
        refuse("sets the YaRN truncate=false; fivefold rounds the correction range to whole pairs as DeepSeek does")
    original = rope.get("original_max_position_embeddings",
                        hf.get("original_max_position_embeddings", hf.get("max_position_embeddings", 2048)))
    # transformers reads a null or 0 beta as its default, and a null mscale as unset (our 0).
    ours = dict(rope_yarn_factor=float(rope["factor"]), rope_original_max_seq_len=int(original),
                rope_yarn_beta_fast=float(rope.get("beta_fast") or 32),
                rope_yarn_beta_slow=float(rope.get("beta_slow") or 1),
                rope_yarn_mscale=float(rope.get("mscale") or 0),
                rope_yarn_mscale_all_dim=float(rope.get("mscale_all_dim") or 0))
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}
    return {**plain, "rope_theta": theta}, ours


def read_config(hf: dict) -> ModelConfig:
    hf = _with_defaults(hf)
    for key in ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
                "n_group", "topk_group", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        positive_int(hf, key)
    q_rank = hf["q_lora_rank"]
    if q_rank is not None and (not isinstance(q_rank, int) or isinstance(q_rank, bool) or q_rank <= 0):
        refuse(f"needs q_lora_rank null (a direct q projection) or a positive integer, got {q_rank!r}")
    heads, kv_heads = hf.get("num_attention_heads"), hf["num_key_value_heads"]
    if kv_heads != heads:
        refuse(f"has num_key_value_heads={kv_heads} and num_attention_heads={heads}; latent attention expands "
               "keys and values for every head, so set num_key_value_heads to num_attention_heads")
    if not hf["rope_interleave"]:
        refuse("sets rope_interleave=false; fivefold's deepseek_v3 rotates interleaved channel pairs, as "
               "DeepSeek's checkpoints are laid out")
    if hf["qk_rope_head_dim"] % 2:
        refuse(f"has qk_rope_head_dim={hf['qk_rope_head_dim']}; RoPE needs an even number of channels")
    n_experts, n_group, topk_group = hf["n_routed_experts"], hf["n_group"], hf["topk_group"]
    if n_experts % n_group or topk_group > n_group:
        refuse(f"has n_routed_experts={n_experts}, n_group={n_group} and topk_group={topk_group}; the groups "
               "must split the experts evenly and topk_group must not exceed n_group")
    if hf["num_experts_per_tok"] == 1 and hf["norm_topk_prob"]:  # models/moe/layer.py renormalises only when top_k > 1
        refuse("sets num_experts_per_tok=1 with norm_topk_prob=true, which weights the one expert by 1, while "
               "fivefold weights a single expert by its router score")
    first_dense = hf["first_k_dense_replace"]
    if not isinstance(first_dense, int) or isinstance(first_dense, bool) or not 0 <= first_dense < hf.get(
            "num_hidden_layers", 0):
        refuse(f"has first_k_dense_replace={first_dense!r}; fivefold's deepseek_v3 needs 0 <= it < "
               "num_hidden_layers (at least one MoE layer)")
    # Keys of DeepSeek's own files that transformers' class ignores: refused unless they say what it does.
    for key, means in (("moe_layer_freq", 1), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if key in hf and hf[key] != means:
            refuse(f"sets {key}={hf[key]!r}, which transformers' DeepseekV3ForCausalLM ignores (it runs "
                   f"{key}={means!r}); fivefold reads only {means!r}")
    plain, yarn = _yarn_from_hf(hf)
    keys = decoder_keys_from_hf(plain)
    keys["head_dim"] = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
    moe = MoEConfig(n_experts=n_experts, top_k=hf["num_experts_per_tok"], n_shared_experts=hf["n_shared_experts"],
                    first_dense=first_dense, expert_ffn_dim=hf["moe_intermediate_size"], score="sigmoid",
                    balance="bias", norm_topk_prob=bool(hf["norm_topk_prob"]), n_group=n_group, topk_group=topk_group,
                    routed_scaling_factor=float(hf["routed_scaling_factor"]))
    mtp_depth = hf["num_nextn_predict_layers"]
    if not isinstance(mtp_depth, int) or isinstance(mtp_depth, bool) or mtp_depth < 0:
        refuse(f"has num_nextn_predict_layers={mtp_depth!r}; it must be a whole number >= 0")
    return ModelConfig(family="deepseek_v3", moe=moe, mtp_depth=mtp_depth, q_lora_rank=q_rank or 0,
                       kv_lora_rank=hf["kv_lora_rank"],
                       qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                       v_head_dim=hf["v_head_dim"], **keys, **yarn)


def write_config(cfg: ModelConfig, dtype) -> dict:
    m = cfg.moe
    shaped = (m.score == "sigmoid" and m.capacity_factor == 0 and m.every == 1 and not m.dense_layers
              and m.n_shared_experts > 0)
    if not shaped:
        raise ConfigError(f"model.moe (n_experts={m.n_experts}) is not DeepSeek-V3-shaped: Hugging Face export "
                          "needs a sigmoid router, at least one shared expert, every layer after "
                          "model.moe.first_dense MoE (every=1, no dense_layers), dropless")
    out = decoder_hf_config(cfg, dtype, "deepseek_v3", "DeepseekV3ForCausalLM")
    for key in ("head_dim", "mlp_bias"):  # transformers derives head_dim (= qk_rope_head_dim)
        del out[key]
    if cfg.rope_yarn_factor > 0:
        yarn = {"rope_type": "yarn", "factor": cfg.rope_yarn_factor,
                "original_max_position_embeddings": cfg.rope_original_max_seq_len,
                "beta_fast": cfg.rope_yarn_beta_fast, "beta_slow": cfg.rope_yarn_beta_slow}
        yarn.update({key: value for key, value in (("mscale", cfg.rope_yarn_mscale),
                                                   ("mscale_all_dim", cfg.rope_yarn_mscale_all_dim)) if value})
        out["rope_scaling"] = yarn
    # norm_topk_prob with top_k 1 would weight the expert by 1; ours keeps its score (moe.py).
    out.update(num_key_value_heads=cfg.n_heads, q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
               qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
               v_head_dim=cfg.v_head_dim, rope_interleave=True, n_routed_experts=m.n_experts,
               num_experts_per_tok=m.top_k, n_shared_experts=m.n_shared_experts,
               moe_intermediate_size=m.expert_ffn_dim or cfg.ffn_dim, first_k_dense_replace=m.first_dense,
               n_group=m.n_group, topk_group=m.topk_group, routed_scaling_factor=m.routed_scaling_factor,
               norm_topk_prob=m.norm_topk_prob and m.top_k > 1, num_nextn_predict_layers=cfg.mtp_depth)
    return out


ADAPTER = HFAdapter(model_type=HF_MODEL_TYPES["deepseek_v3"], names=NAMES, experts=EXPERTS, read_config=read_config,
                    write_config=write_config, ours_only=NOTHING, dropped_by_hf=dropped_on_read,
                    hf_copies=mtp_copies, fit_to_files=fit_to_files)
