"""The weight matrices of one transformer block as the model stores them: name, shape, kind, how
tensor parallelism splits each, and the experts' stacks. Pure arithmetic on ModelStats; what Muon
orthogonalises (plan/muon.py) and what LoRA adapts (plan/lora.py). tests/test_plan_muon.py and
tests/test_plan_lora.py hold them to the built model's parameters, names and order included."""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.plan.gemm import mlp_matrices
from fivefold.plan.model_stats import ModelStats

# How tensor parallelism splits a matrix (parallel/tensor/): its rows, the output features
# (column-parallel: q, k, v, an MLP's up matrices), its columns, the input features (row-parallel:
# the attention output and the MLP's down projection), or not at all (an MoE layer's weights and
# latent attention's down-projections run whole on every tp rank).
ROWS, COLS, WHOLE = "rows", "cols", ""


@dataclass(frozen=True)
class BlockMatrix:
    name: str  # under the block (layers.<i>.): the single-device parameter name
    shape: tuple[int, int]  # (rows = out, cols = in) of each of its matrices, whole
    kind: str  # models/param_kinds.py: attention, mlp, experts, router
    split: str = WHOLE  # ROWS, COLS or WHOLE under tp
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
    """One block's matrices in the model's parameter order (models/decoder.py,
    models/deepseek_v3/model.py, models/moe.py): attention's projections, then the dense MLP's
    matrices, or the router, the routed experts (w1, w2, w3 stacked, n_experts/ep here) and the
    shared experts. Norms, biases, sinks and multi-token prediction's eh_proj are not matrices of
    these kinds."""
    h = stats.dim

    def attention(name, rows, cols, split=ROWS):
        return BlockMatrix(f"attention.{name}.weight", (rows, cols), "attention", split)

    if stats.kv_lora_rank:  # latent attention
        qk, rank = stats.n_heads * stats.head_dim, stats.q_lora_rank
        q = ((attention("q_a_proj", rank, h, WHOLE), attention("q_b_proj", qk, rank)) if rank
             else (attention("q_proj", qk, h),))
        nope = stats.head_dim - stats.rope_dim
        out = [*q, attention("kv_a_proj_with_mqa", stats.kv_lora_rank + stats.rope_dim, h, WHOLE),
               attention("kv_b_proj", stats.n_heads * (nope + (stats.v_head_dim or stats.head_dim)),
                         stats.kv_lora_rank),
               attention("o_proj", h, stats.o_dim, COLS)]
    else:
        out = [attention("wq", stats.q_dim, h), attention("wk", stats.kv_dim, h), attention("wv", stats.v_dim, h),
               attention("wo", h, stats.o_dim, COLS)]
    if not stats.is_moe(layer):
        # SwiGLU's w1 (gate), w2 (down), w3 (up); a two-matrix MLP has w1 (up) and w2 (down).
        f = stats.ffn_dim
        mlp = [("w1", (f, h), ROWS), ("w2", (h, f), COLS), ("w3", (f, h), ROWS)][:mlp_matrices(stats)]
        return tuple(out + [BlockMatrix(f"feed_forward.{n}.weight", s, "mlp", split) for n, s, split in mlp])
    out.append(BlockMatrix("feed_forward.router.gate.weight", (stats.n_experts, h), "router"))
    hidden, local = round(stats.expert_hidden), max(1, stats.n_experts // ep)
    for name, shape in (("w1", (hidden, h)), ("w2", (h, hidden)), ("w3", (hidden, h))):
        out.append(BlockMatrix(f"feed_forward.experts.{name}", shape, "experts", count=local))
    if stats.shared_expert_params:  # an MLP inside the MoE, whole on every tp rank like the rest of it
        width = stats.shared_expert_params // (3 * h)
        out += [BlockMatrix(f"feed_forward.shared.{name}.weight", shape, "mlp")
                for name, shape in (("w1", (width, h)), ("w2", (h, width)), ("w3", (width, h)))]
    return tuple(out)
