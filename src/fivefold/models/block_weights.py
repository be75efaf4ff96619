"""The weight matrices of one decoder block as the families store them: single-device name, shape
(rows = out features, cols = in features), kind (models/param_kinds.py), and which axis runs over
heads or hidden units. Pure arithmetic on ModelStats (no torch), so that the planner can price what
is done per matrix (Muon's orthogonalisation, LoRA's adapters) without knowing the families' module
names; tests/test_plan_muon.py and tests/test_plan_lora.py hold the list to the built model's
parameters, names and order included."""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config.lora import parse_targets
from fivefold.models.decoder_stats import ModelStats

# The axis of a matrix that runs over heads or hidden units: its rows (q, k, v, an MLP's gate and up
# projections), its columns (the attention output and the MLP's down projection), or neither (the
# router, and latent attention's down-projections into its compressed width).
ROWS, COLS, NEITHER = "rows", "cols", ""


@dataclass(frozen=True)
class BlockWeight:
    name: str  # under the block (layers.<i>.): the single-device parameter name
    shape: tuple[int, int]  # (rows, cols) of each of its matrices
    kind: str  # attention, mlp, experts, router
    unit_axis: str = NEITHER  # ROWS, COLS or NEITHER
    in_moe: bool = False  # inside an MoE layer (router, routed and shared experts)
    stacked: bool = False  # one matrix per routed expert, stacked in one tensor


def block_weights(stats: ModelStats, layer: int) -> tuple[BlockWeight, ...]:
    """One block's matrices in the model's parameter order (models/decoder.py,
    models/deepseek_v3/model.py, models/moe/layer.py): attention's projections, then the dense MLP's
    matrices, or the router, the routed experts (w1, w2, w3 stacked) and the shared experts. Norms,
    biases, sinks and multi-token prediction's eh_proj are not matrices of these kinds."""
    h = stats.dim

    def attention(name, rows, cols, axis=ROWS):
        return BlockWeight(f"attention.{name}.weight", (rows, cols), "attention", axis)

    if stats.kv_lora_rank:  # latent attention
        qk, rank = stats.n_heads * stats.head_dim, stats.q_lora_rank
        q = ((attention("q_a_proj", rank, h, NEITHER), attention("q_b_proj", qk, rank)) if rank
             else (attention("q_proj", qk, h),))
        nope = stats.head_dim - stats.rope_dim
        out = [*q, attention("kv_a_proj_with_mqa", stats.kv_lora_rank + stats.rope_dim, h, NEITHER),
               attention("kv_b_proj", stats.n_heads * (nope + (stats.v_head_dim or stats.head_dim)),
                         stats.kv_lora_rank),
               attention("o_proj", h, stats.o_dim, COLS)]
    else:
        out = [attention("wq", stats.q_dim, h), attention("wk", stats.kv_dim, h), attention("wv", stats.v_dim, h),
               attention("wo", h, stats.o_dim, COLS)]
    if not stats.is_moe(layer):
        # SwiGLU's w1 (gate), w2 (down), w3 (up); a two-matrix MLP has w1 (up) and w2 (down).
        f = stats.ffn_dim
        mlp = [("w1", (f, h), ROWS), ("w2", (h, f), COLS), ("w3", (f, h), ROWS)][:stats.mlp_matrices]
        return tuple(out + [BlockWeight(f"feed_forward.{n}.weight", s, "mlp", axis) for n, s, axis in mlp])
    out.append(BlockWeight("feed_forward.router.gate.weight", (stats.n_experts, h), "router", in_moe=True))
    hidden = round(stats.expert_hidden)
    for name, shape, axis in (("w1", (hidden, h), ROWS), ("w2", (h, hidden), COLS), ("w3", (hidden, h), ROWS)):
        out.append(BlockWeight(f"feed_forward.experts.{name}", shape, "experts", axis, in_moe=True, stacked=True))
    if stats.shared_expert_params:
        width = stats.shared_expert_params // (3 * h)
        out += [BlockWeight(f"feed_forward.shared.{name}.weight", shape, "mlp", axis, in_moe=True)
                for name, shape, axis in (("w1", (width, h), ROWS), ("w2", (h, width), COLS), ("w3", (width, h), ROWS))]
    return tuple(out)


def adapter_params_per_token(stats: ModelStats, rank: int, targets: str) -> float:
    """LoRA adapter parameters one token passes through: A (rank x in) and B (out x rank) beside
    each matrix lora.targets selects (config/lora.py), the routed experts' for the top_k a token
    visits. Multi-token prediction's blocks count like the layers."""
    chosen, total = parse_targets(targets), 0.0
    for layer in range(stats.n_layers + stats.mtp_depth):
        for w in block_weights(stats, layer):
            if chosen.selects(f"layers.{layer}.{w.name}", w.kind):
                total += (stats.top_k if w.stacked else 1) * rank * (w.shape[0] + w.shape[1])
    return total
