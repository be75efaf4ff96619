"""The ModelSpec pieces every family built on models/decoder.py shares: its tensor-parallel plan,
stage ends, tie and constructor. A family's spec.py picks its variant and its Hugging Face adapter.
"""

from __future__ import annotations

import torch

from fivefold.config import ModelConfig
from fivefold.models.decoder import TIED, Transformer, initial_values
from fivefold.models.hf.adapter import HFAdapter
from fivefold.models.moe.layer import is_moe_layer
from fivefold.models.spec import TP, ModelSpec

ROOT_PLAN = {"tok_embeddings": TP.VOCAB_EMBEDDING, "norm": TP.STREAM_NORM, "output": TP.VOCAB_OUTPUT}


def decoder_block_plan(cfg: ModelConfig, index: int, qk_norm: bool) -> dict[str, str]:
    """Attention: q/k/v split by heads, wo by its input; the whole sequence gathered in order
    (positions matter). Dense MLP: w1/w3 split by hidden units, w2 by its input; its input is
    gathered in any token order (it is per token). MoE layers keep their weights whole on every
    tp rank and route each rank's own slice of the tokens (parallel/tensor/apply.py; parallel/expert/apply.py
    spreads their experts over ep)."""
    plan = {"attention": TP.WHOLE_SEQUENCE_IN, "attention.wq": TP.COLUMN, "attention.wk": TP.COLUMN,
            "attention.wv": TP.COLUMN, "attention.wo": TP.ROW_TO_SEQUENCE,
            "attention_norm": TP.STREAM_NORM, "ffn_norm": TP.STREAM_NORM}
    if qk_norm:  # shared by the heads, each tp rank normalises only its own heads
        plan.update({"attention.q_norm": TP.PARTIAL_NORM, "attention.k_norm": TP.PARTIAL_NORM})
    if is_moe_layer(cfg, index):
        plan["feed_forward"] = TP.REPLICATED_MOE
    else:
        plan.update({"feed_forward": TP.ALL_TOKENS_IN, "feed_forward.w1": TP.COLUMN,
                     "feed_forward.w2": TP.ROW_TO_TOKENS})
        if cfg.mlp_activation == "swiglu":  # a two-matrix MLP (gelu, relu2) has no w3
            plan["feed_forward.w3"] = TP.COLUMN
    return plan


def decoder_tied(cfg: ModelConfig) -> dict[str, str]:
    return dict(TIED) if cfg.tie_embeddings else {}


def decoder_spec(name: str, hf: HFAdapter, qk_norm: bool, experts: str, other_kind: str) -> ModelSpec:
    def build(cfg: ModelConfig) -> torch.nn.Module:
        return Transformer(cfg, qk_norm=qk_norm)

    return ModelSpec(
        name=name, build=build, initial_values=initial_values,
        block_plan=lambda cfg, index: decoder_block_plan(cfg, index, qk_norm), root_plan=ROOT_PLAN,
        attention_core="attention.core", first_stage=("tok_embeddings",), last_stage=("norm", "output"),
        tied=decoder_tied, hf=hf, experts=experts, other_kind=other_kind)
