"""LoRA ([lora], models/lora/adapters.py) in the planner: the adapters a rank holds, and what they add to a
block's activations. The base weights are frozen: they keep their weights' bytes (plan/memory/peak.py:
bf16 or fp32 as the recipe stores weights, whole under ZeRO-1/2, sharded by FSDP2 at zero 3) but
no gradients, optimizer state or master copy. Only the adapters are trained (AdamW: LoRA refuses
Muon), reduced and sharded like any trainable weight.

Adapters: A (r x in) and B (out x r) beside each targeted matrix (plan/block_matrices.py; a stack
of each per expert for targeted experts). Under tp each follows its layer
(parallel/tensor/lora.py): beside a column-parallel W (its rows split) A is whole and B's rows
split; beside a row-parallel W (its columns split) A's columns are split and B is whole; beside a W
whole on every tp rank both are whole. Under ep the stacks are sliced with their experts.

Activations, per adapted matrix and token (models/lora/adapters.py: y = W x + s B A dropout(x)): without
recomputation B keeps its input A x (r wide; A's input is W's, kept already); a dropout (p > 0)
keeps the dropped copy of x and its mask (1 byte per element); selective recomputation
(parallel/recompute.py) keeps A x too, and redoes B (A x) in backward rather than keep a tensor as
wide as W's output (it costs r/in of W's matmul); full recomputation keeps nothing more than the
block input. Experts' adapters see each
token's top_k copies, and an MoE layer's matmuls 1/tp of the tokens (parallel/tensor/apply.py).
What only a weight's gradient reads is no longer kept (plan/memory/activations.py): the frozen output
layer's input, an fp32 norm's x·rstd. On the tiny model (one process, tests/test_plan_lora.py)
that is the measured difference to the byte under selective and full recomputation (0.1% off
with dropout); without recomputation and dropout the run keeps 3% less than counted here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from fivefold.config.lora import parse_targets
from fivefold.models.block_weights import COLS, ROWS
from fivefold.plan.block_matrices import BlockMatrix, block_matrices
from fivefold.plan.layout import Layout
from fivefold.plan.model_stats import ModelStats
from fivefold.plan.pipeline.schedule import PipelineRank

MASK_BYTES = 1  # dropout's mask: one bool per element


@dataclass(frozen=True)
class Lora:
    """The [lora] section as the planner needs it (rank 0: off)."""
    rank: int = 0
    targets: str = "attention|mlp"
    dropout: float = 0.0


def adapted(stats: ModelStats, layer: int, ep: int, lora: Lora) -> tuple[BlockMatrix, ...]:
    """The matrices of one block that get adapters (config/lora.py's selection: by kind, or a
    pattern on the single-device name)."""
    return _adapted(stats, layer, ep, lora.targets)


@lru_cache(maxsize=4096)
def _adapted(stats, layer, ep, targets) -> tuple[BlockMatrix, ...]:
    chosen = parse_targets(targets)
    return tuple(m for m in block_matrices(stats, layer, ep) if chosen.selects(f"layers.{layer}.{m.name}", m.kind))


def adapter_params(m: BlockMatrix, rank: int, tp: int) -> float:
    """Elements of the adapters beside m on one tp rank: A (r x in) and B (out x r)."""
    out, inp = m.shape
    a = rank * inp / (tp if m.split == COLS else 1)
    b = out * rank / (tp if m.split == ROWS else 1)
    return m.count * (a + b)


def adapter_param_counts(stats: ModelStats, layout: Layout, prank: PipelineRank, lora: Lora) -> tuple[float, float]:
    """(dense, expert) adapter parameters of one rank, before ZeRO shards them: the only weights
    a LoRA run trains."""
    dense = experts = 0.0
    for layer, count in prank.kinds:
        d, e = layer_adapter_params(stats, layout, layer, lora)
        dense += count * d
        experts += count * e
    return dense, experts


def layer_adapter_params(stats: ModelStats, layout: Layout, layer: int, lora: Lora) -> tuple[float, float]:
    dense = experts = 0.0
    for m in adapted(stats, layer, layout.ep, lora):
        n = adapter_params(m, lora.rank, layout.tp)
        if m.expert:
            experts += n
        else:
            dense += n
    return dense, experts


def adapter_activation_bytes(stats: ModelStats, layer: int, layout: Layout, recompute: str, lora: Lora,
                             act_bytes: int) -> float:
    """Bytes the adapters of one layer keep per token of one micro-batch on one rank (docstring)."""
    if not lora.rank or recompute == "full":
        return 0.0
    t, total = layout.tp, 0.0
    for m in adapted(stats, layer, layout.ep, lora):
        out, inp = m.shape
        # Rows each adapter sees per token of the micro-batch: an expert's, each token's top_k
        # copies; an MoE layer's, 1/tp of the tokens; attention's and a dense MLP's, every token.
        rows = stats.top_k / t if m.expert else (1 / t if stats.is_moe(layer) and m.kind == "mlp" else 1.0)
        if recompute == "selective":  # A x; B (A x) is redone from it (parallel/recompute.py)
            kept = lora.rank * act_bytes
        else:
            kept = lora.rank * act_bytes
            if lora.dropout:
                kept += inp / (t if m.split == COLS else 1) * (act_bytes + MASK_BYTES)
        total += rows * kept
    return total


def matmul_share(lora: Lora) -> float:
    """The share of a weight's training matmul FLOPs (per token: forward 2, input gradient 2, weight
    gradient 2) that run: a frozen weight has no weight gradient, 4 of 6. The adapters' own matmuls,
    about 2r/h of their layer's (0.4% for Llama 3 70B at r = 16), are left out."""
    return 4 / 6 if lora.rank else 1.0


def backward_share(lora: Lora) -> float:
    """The backward's share of a layer's matmul time: 4 of 6 FLOPs per weight, 2 of 4 when frozen."""
    return 0.5 if lora.rank else 2 / 3
