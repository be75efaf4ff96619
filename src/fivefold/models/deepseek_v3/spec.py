"""The deepseek_v3 ModelSpec: the decoder's skeleton, stage ends and tie with latent attention.

Tensor parallelism splits the heads: q_b_proj (or q_proj) and kv_b_proj by output rows (each head's
rows are contiguous), o_proj by its input. The latent down-projections and their norms are small
(d x 2k) and run whole on every tp rank on the gathered sequence; since each rank's heads use only
part of what they produce (and the shared RoPE key), their gradients are partial sums over tp.

Multi-token prediction's blocks (models/mtp.py; layers n_layers and up) are laid out as the other
layers, their extra norms as stream norms and eh_proj whole on every tp rank, on the stream (so under
sequence parallelism it sees this rank's tokens and its gradient is a partial sum). They embed with
`mtp_embeddings`, a tied copy of the embedding matrix split as the embedding is.
"""

from __future__ import annotations

import torch

from fivefold.config import ModelConfig
from fivefold.models.decoder_spec import ROOT_PLAN, decoder_block_plan, decoder_tied
from fivefold.models.deepseek_v3.hf import ADAPTER
from fivefold.models.deepseek_v3.model import DeepseekV3Transformer, initial_values
from fivefold.models.spec import TP, ModelSpec


def block_plan(cfg: ModelConfig, index: int) -> dict[str, str]:
    # The feed-forward and stream norms exactly as the decoder's (dense MLP split, MoE replicated).
    plan = {path: style for path, style in decoder_block_plan(cfg, index, qk_norm=False).items()
            if path != "attention" and not path.startswith("attention.")}
    plan.update({"attention": TP.WHOLE_SEQUENCE_IN,
                 "attention.kv_a_proj_with_mqa": TP.REPLICATED_PARTIAL,
                 "attention.kv_a_layernorm": TP.PARTIAL_NORM,
                 "attention.kv_b_proj": TP.COLUMN,
                 "attention.o_proj": TP.ROW_TO_SEQUENCE})
    if index >= cfg.n_layers:  # a multi-token-prediction block
        plan.update({"enorm": TP.STREAM_NORM, "hnorm": TP.STREAM_NORM, "head_norm": TP.STREAM_NORM,
                     "eh_proj": TP.STREAM_LINEAR})
    if cfg.q_lora_rank:
        plan.update({"attention.q_a_proj": TP.REPLICATED_PARTIAL, "attention.q_a_layernorm": TP.PARTIAL_NORM,
                     "attention.q_b_proj": TP.COLUMN})
    else:
        plan["attention.q_proj"] = TP.COLUMN
    return plan


def build(cfg: ModelConfig) -> torch.nn.Module:
    return DeepseekV3Transformer(cfg)


def tied(cfg: ModelConfig) -> dict[str, str]:
    pairs = decoder_tied(cfg)
    if cfg.mtp_depth:
        pairs["mtp_embeddings.weight"] = "tok_embeddings.weight"
    return pairs


SPEC = ModelSpec(
    name="deepseek_v3", build=build, initial_values=initial_values, block_plan=block_plan,
    root_plan={**ROOT_PLAN, "mtp_embeddings": TP.VOCAB_EMBEDDING}, attention_core="attention.core",
    first_stage=("tok_embeddings",), last_stage=("norm", "output", "mtp_embeddings"), tied=tied, hf=ADAPTER,
    experts="required", experts_why="its layers after model.moe.first_dense are MoE", other_kind="llama",
    multi_token_prediction=True)
