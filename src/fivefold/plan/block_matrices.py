"""The weight matrices of one transformer block as a layout holds them: the model's list
(models/block_weights.py: names, shapes, kinds), with how tensor parallelism splits each and how
many routed experts a rank holds. What Muon orthogonalises (plan/muon.py) and what LoRA adapts
(plan/lora.py)."""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.models.block_weights import NEITHER, block_weights
from fivefold.plan.model_stats import ModelStats

# How tensor parallelism splits a matrix (parallel/tensor/): along the axis that runs over heads or
# hidden units, its rows (column-parallel: q, k, v, an MLP's up matrices) or its columns
# (row-parallel: the attention output and the MLP's down projection), or not at all (an MoE layer's
# weights and latent attention's down-projections run whole on every tp rank).
WHOLE = NEITHER


@dataclass(frozen=True)
class BlockMatrix:
    name: str  # under the block (layers.<i>.): the single-device parameter name
    shape: tuple[int, int]  # (rows = out, cols = in) of each of its matrices, whole
    kind: str  # models/param_kinds.py: attention, mlp, experts, router
    split: str = WHOLE  # ROWS, COLS (models/block_weights.py) or WHOLE under tp
    count: int = 1  # matrices stacked in it: a rank's local experts

    @property
    def tp_split(self) -> bool:
        return self.split != WHOLE

    @property
    def expert(self) -> bool:
        return self.kind == "experts"

    @property
    def numel(self) -> int:
        return self.count * self.shape[0] * self.shape[1]


def block_matrices(stats: ModelStats, layer: int, ep: int) -> tuple[BlockMatrix, ...]:
    """One block's matrices in the model's parameter order, on a rank of expert parallelism `ep`:
    tp splits each along its heads or hidden units, except inside an MoE layer, which runs whole on
    every tp rank; the routed experts' stacks hold n_experts/ep."""
    local = max(1, stats.n_experts // ep)
    return tuple(BlockMatrix(w.name, w.shape, w.kind, WHOLE if w.in_moe else w.unit_axis,
                             local if w.stacked else 1) for w in block_weights(stats, layer))
