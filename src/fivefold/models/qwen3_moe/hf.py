"""Hugging Face Qwen3MoeForCausalLM <-> fivefold's qwen3_moe family.

transformers 5 holds a layer's experts fused in memory but saves them one matrix per expert
(`mlp.experts.{expert}.gate_proj.weight`), which is what we read and write. Its config.json names
the expert count `num_local_experts` (Qwen's own files: `num_experts`); both are read. Sparse
layers: layer i is MoE unless listed in mlp_only_layers, when (i + 1) is a multiple of
decoder_sparse_step — in our keys first_dense = step - 1, every = step, dense_layers = the list.
"""

from fivefold.config import ConfigError, ModelConfig, MoEConfig
from fivefold.config.families import HF_MODEL_TYPES
from fivefold.models.hf.adapter import HFAdapter
from fivefold.models.hf.config import decoder_hf_config, decoder_keys_from_hf, positive_int, refuse
from fivefold.models.llama.hf import ATTENTION_NAMES, DENSE_MLP_NAMES
from fivefold.models.moe.layout import is_moe_layer
from fivefold.models.qwen3.hf import QK_NORM_NAMES

_MLP = "model.layers.{layer}.mlp"


def read_config(hf: dict) -> ModelConfig:
    n_experts = hf.get("num_local_experts", hf.get("num_experts"))
    if not isinstance(n_experts, int) or isinstance(n_experts, bool) or n_experts <= 0:
        # Qwen3MoeConfig would take its default of 128 experts; a file without the count is refused.
        refuse(f"needs a positive integer num_local_experts (or num_experts), got {n_experts!r}")
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        positive_int(hf, key)
    step = hf.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
        refuse(f"needs a positive integer decoder_sparse_step, got {step!r}")
    only_dense = hf.get("mlp_only_layers") or []
    if not isinstance(only_dense, list) or not all(isinstance(i, int) for i in only_dense):
        refuse(f"needs mlp_only_layers as a list of layer indices, got {only_dense!r}")
    norm_topk_prob = bool(hf.get("norm_topk_prob", False))
    if hf["num_experts_per_tok"] == 1 and norm_topk_prob:  # models/moe/layer.py renormalises only when top_k > 1
        refuse("sets num_experts_per_tok=1 with norm_topk_prob=true, which weights the one expert by 1, "
               "while fivefold weights a single expert by its router probability")
    keys = decoder_keys_from_hf(hf, gated_window=True)
    # Indices past the last layer select nothing in transformers; our dense_layers must not name them.
    only_dense = sorted({i for i in only_dense if 0 <= i < keys["n_layers"]})
    moe = MoEConfig(n_experts=n_experts, top_k=hf["num_experts_per_tok"],
                    expert_ffn_dim=hf["moe_intermediate_size"], score="softmax", balance="aux_loss",
                    aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)),
                    norm_topk_prob=norm_topk_prob, first_dense=step - 1, every=step,
                    dense_layers=",".join(map(str, only_dense)))
    return ModelConfig(family="qwen3_moe", moe=moe, **keys)


def _sparse_layers(cfg: ModelConfig) -> tuple[int, list[int]]:
    """(decoder_sparse_step, mlp_only_layers) with our MoE layers: our `every` where our MoE layers
    start at every - 1 as transformers' do, else step 1 with each dense layer listed (any pattern)."""
    m = cfg.moe
    step = m.every if m.first_dense == m.every - 1 else 1
    only = [i for i in range(cfg.n_layers) if (i + 1) % step == 0 and not is_moe_layer(cfg, i)]
    return step, only


def write_config(cfg: ModelConfig, dtype) -> dict:
    m = cfg.moe
    qwen = (m.score == "softmax" and m.balance != "bias" and m.n_shared_experts == 0 and m.capacity_factor == 0
            and m.n_group == 1 and m.routed_scaling_factor == 1.0)
    if not qwen:
        raise ConfigError(f"model.moe (n_experts={m.n_experts}) is not Qwen3-MoE-shaped: Hugging Face export "
                          "needs a softmax router without bias balancing, shared experts, group-limited "
                          "routing or routed scaling, dropless")
    step, only_dense = _sparse_layers(cfg)
    out = decoder_hf_config(cfg, dtype, "qwen3_moe", "Qwen3MoeForCausalLM")
    # norm_topk_prob with top_k 1 would weight the expert by 1; ours keeps its probability (moe.py).
    # `num_experts`, as Qwen's files say it: transformers 5 maps it to num_local_experts, 4.x reads only it.
    out.update(num_experts=m.n_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.expert_ffn_dim or cfg.ffn_dim,
               norm_topk_prob=m.norm_topk_prob and m.top_k > 1, decoder_sparse_step=step,
               mlp_only_layers=only_dense, router_aux_loss_coef=m.aux_loss_coeff,
               use_sliding_window=False, sliding_window=None, output_router_logits=False)
    del out["mlp_bias"]
    return out


ADAPTER = HFAdapter(
    model_type=HF_MODEL_TYPES["qwen3_moe"],
    names=ATTENTION_NAMES + QK_NORM_NAMES + DENSE_MLP_NAMES
    + [(f"{_MLP}.gate.weight", "layers.{layer}.feed_forward.router.gate.weight")],
    experts=[(f"{_MLP}.experts.{{expert}}.gate_proj.weight", "layers.{layer}.feed_forward.experts.w1"),
             (f"{_MLP}.experts.{{expert}}.down_proj.weight", "layers.{layer}.feed_forward.experts.w2"),
             (f"{_MLP}.experts.{{expert}}.up_proj.weight", "layers.{layer}.feed_forward.experts.w3")],
    read_config=read_config, write_config=write_config)
