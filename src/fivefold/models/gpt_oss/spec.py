"""The gpt_oss ModelSpec: the decoder's skeleton, stage ends and tie, with gpt-oss's attention and
experts (models/gpt_oss/model.py).

Tensor parallelism lays out the biases with their projections (q/k/v's split by heads, the output
projection's added once after the sum) and splits the per-head sink logits by heads as q is
(TP.HEAD_VALUES); the MoE layers keep their weights, router and expert biases whole on every tp
rank, as every family's do. Context parallelism has neither windows nor sinks yet, and is refused
for them (config/validate_attention.py).
"""

from __future__ import annotations

import torch

from fivefold.config import ConfigError, ModelConfig
from fivefold.models.decoder import initial_values
from fivefold.models.decoder_spec import ROOT_PLAN, decoder_block_plan, decoder_tied
from fivefold.models.gpt_oss.hf import ADAPTER
from fivefold.models.gpt_oss.model import GptOssTransformer
from fivefold.models.moe.layout import is_moe_layer
from fivefold.models.spec import TP, ModelSpec


def block_plan(cfg: ModelConfig, index: int) -> dict[str, str]:
    plan = decoder_block_plan(cfg, index, qk_norm=False)
    if cfg.attention_sinks:
        plan["attention.sinks"] = TP.HEAD_VALUES
    return plan


def check(cfg: ModelConfig) -> None:
    m = cfg.moe
    if not all(is_moe_layer(cfg, i) for i in range(cfg.n_layers)):
        raise ConfigError("model.family=gpt_oss has no dense layers yet (every gpt-oss layer is MoE); set "
                          "model.moe.every=1, model.moe.first_dense=0 and model.moe.dense_layers=''")
    if m.n_shared_experts:
        raise ConfigError(f"model.moe.n_shared_experts={m.n_shared_experts} is not yet available in "
                          "model.family=gpt_oss (its experts are routed only); set it to 0")
    if cfg.rope_yarn_mscale or cfg.rope_yarn_mscale_all_dim:
        raise ConfigError("model.rope_yarn_mscale and rope_yarn_mscale_all_dim are DeepSeek's YaRN scalings, "
                          "not available in model.family=gpt_oss; set both to 0")


def build(cfg: ModelConfig) -> torch.nn.Module:
    return GptOssTransformer(cfg)


SPEC = ModelSpec(
    name="gpt_oss", build=build, initial_values=initial_values, block_plan=block_plan, root_plan=ROOT_PLAN,
    attention_core="attention.core", first_stage=("tok_embeddings",), last_stage=("norm", "output"),
    tied=decoder_tied, hf=ADAPTER, experts="required", experts_why="every gpt-oss layer is MoE", other_kind="llama",
    check=check)
