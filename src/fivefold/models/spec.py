"""ModelSpec: everything the rest of fivefold needs to know about a model family, in one object.

`parallel/`, `train/`, `plan/` and `convert` read a family's spec and never name its modules: the
spec says which modules tensor parallelism splits and how, which module context parallelism
swaps, what a pipeline stage keeps at its ends, which parameters are tied, how Hugging Face names
and lays out the weights. A family is a folder `models/<family>/` whose `spec.py` defines `SPEC`
and whose `stats.py` defines `stats(cfg)` (the planner's parameter and FLOP counts, pure arithmetic:
the planner runs without importing torch), plus one line in models/registry.py.

Module paths are relative: a block plan's paths to one transformer block (`layers.<i>`), the other
paths to the whole model. The model itself must follow three conventions the dimensions rely on:
its blocks live in a ModuleDict `layers` keyed by layer index (a pipeline stage deletes some and
keeps the others' names), the stage-end modules may be None (the model's forward skips them), and
the attention core is a parameter-free module taking (q, k, v) of shape (batch, heads, seq, head_dim)
— k/v possibly with fewer heads — and returning the attention output of q's shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from fivefold.config import ModelConfig
from fivefold.models.hf.adapter import HFAdapter
from fivefold.models.init import Fill


class TP:
    """How tensor parallelism lays out a module (the styles parallel/tensor/apply.py implements).

    Megatron's layout: a block's column-split projections (heads, hidden units) take the whole
    stream and its row-split projections' partial outputs are summed back into it, one all-reduce
    (or under sequence parallelism a reduce-scatter and an all-gather) per sub-layer. A projection's
    bias is laid out with its output: split with a column-split one, added once after the sum of a
    row-split one, replicated with a replicated one."""

    COLUMN = "column"  # nn.Linear split by output features; computes on the local shard
    ROW_TO_SEQUENCE = "row_to_sequence"  # nn.Linear split by input features; partial sums -> stream, in order
    ROW_TO_TOKENS = "row_to_tokens"  # the same for a per-token sub-layer, any token order
    WHOLE_SEQUENCE_IN = "whole_sequence_in"  # the module's first input is gathered in sequence order
    ALL_TOKENS_IN = "all_tokens_in"  # ... gathered in any order (per-token sub-layers, e.g. the MLP)
    STREAM_NORM = "stream_norm"  # RMSNorm on the stream: sequence-sharded under sp, untouched otherwise
    # RMSNorm replicated on every tp rank that sees only this rank's share of its rows (per-head q/k
    # norms see the local heads): its gradient is a partial sum, summed over tp before the update.
    PARTIAL_NORM = "partial_norm"
    # nn.Linear replicated on every tp rank, computing on the whole (gathered) input, whose output
    # feeds column-split layers (a latent down-projection, as in MLA): its gradient is a partial sum.
    REPLICATED_PARTIAL = "replicated_partial"
    # nn.Linear replicated on every tp rank, applied per token to the stream (multi-token
    # prediction's eh_proj): under sequence parallelism it sees this rank's tokens only, so its
    # gradient is a partial sum; on a whole, replicated stream it runs as it is.
    STREAM_LINEAR = "stream_linear"
    # MoE layer: weights whole on every tp rank, tokens split (each rank routes its own slice)
    REPLICATED_MOE = "replicated_moe"
    # A module holding one value per attention head along dim 0 (attention sinks, models/decoder.py
    # HeadValues): split by heads as q is; it returns this rank's heads.
    HEAD_VALUES = "head_values"
    VOCAB_EMBEDDING = "vocab_embedding"  # nn.Embedding split by vocabulary rows
    VOCAB_OUTPUT = "vocab_output"  # nn.Linear split by vocabulary; logits stay sharded for the loss

    ALL = (COLUMN, ROW_TO_SEQUENCE, ROW_TO_TOKENS, WHOLE_SEQUENCE_IN, ALL_TOKENS_IN, STREAM_NORM,
           PARTIAL_NORM, REPLICATED_PARTIAL, STREAM_LINEAR, REPLICATED_MOE, HEAD_VALUES, VOCAB_EMBEDDING,
           VOCAB_OUTPUT)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    # The single-device model of a config; the caller chooses the device (meta for training).
    build: Callable[[ModelConfig], nn.Module]
    # fill(name, whole_shape, offsets, sizes) of the seeded initial weights (models/init.py).
    initial_values: Callable[[ModelConfig, int], Fill]
    # Tensor-parallel style (TP.*) of each module of block `i`, by path inside the block.
    block_plan: Callable[[ModelConfig, int], dict[str, str]]
    # ... of the modules outside the blocks, by path in the model.
    root_plan: dict[str, str]
    # Path inside a block of the attention core that context parallelism replaces. The core is
    # called as core(q, k, v, documents[, sinks]) and may carry `window` (its sliding window, 0: none).
    attention_core: str
    # Modules only the first / the last pipeline stage keeps (set to None elsewhere).
    first_stage: tuple[str, ...]
    last_stage: tuple[str, ...]
    # Tied parameters of a config: copy -> source (the copy is the same tensor, saved once as the source).
    tied: Callable[[ModelConfig], dict[str, str]]
    hf: HFAdapter
    # Family facts, checked in one place (configure/model_rules.py check_family): whether its layers
    # carry experts ("none": dense only; "required": MoE only, `experts_why` says why), and the
    # family a config of the other kind should name instead.
    experts: str = "none"
    experts_why: str = ""
    other_kind: str = ""
    # Whether the family builds model.mtp_depth multi-token-prediction blocks (models/mtp.py).
    multi_token_prediction: bool = False
    # What the facts above cannot say, one sentence each (raise ConfigError).
    check: Callable[[ModelConfig], None] = field(default=lambda cfg: None)
