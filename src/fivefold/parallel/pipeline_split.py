"""Cutting the model into pipeline stages: which layers each stage holds and which rank runs it.

Pure arithmetic (no process groups), so validation, the planner and the rank map can use it.
"""

from __future__ import annotations

from fivefold.config import ModelConfig

# Schedules whose ranks hold two stages in a "V": rank r runs stages r and 2·pp-1-r, so the first
# and the last stage (embedding and output) sit on the same rank.
V_SCHEDULES = ("zbv", "dualpipev")
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")


def stage_to_rank(stage: int, pp: int, schedule: str) -> int:
    n_stages = 2 * pp if schedule in V_SCHEDULES else None
    if n_stages is not None:
        return stage if stage < pp else n_stages - 1 - stage
    return stage % pp  # loop: rank r runs stages r, r+pp, r+2·pp, ...


def stages_of_rank(rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    return [s for s in range(pp * virtual) if stage_to_rank(s, pp, schedule) == rank]


def layer_cost(cfg: ModelConfig) -> float:
    """Matmul parameters of one transformer block (proportional to its FLOPs per token)."""
    kv_dim = cfg.n_kv_heads * cfg.head_dim
    return 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv_dim + 3 * cfg.dim * cfg.ffn_dim


def output_cost(cfg: ModelConfig) -> float:
    """The output projection (and, folded in, the loss) runs on the last stage."""
    return cfg.dim * cfg.vocab_size


def balanced_layer_counts(cfg: ModelConfig, n_stages: int) -> list[int]:
    """Contiguous layer counts per stage minimising the most expensive stage, the last stage also
    carrying the output layer (the embedding lookup costs next to nothing). Every stage gets at
    least one layer."""
    layer, last_extra = layer_cost(cfg), output_cost(cfg)
    n_layers = cfg.n_layers

    def stages_needed(limit: float) -> int | None:
        # Greedy from the end: the last stage has the output layer's cost on top of its layers.
        counts, remaining = [], n_layers
        for stage in reversed(range(n_stages)):
            budget = limit - (last_extra if stage == n_stages - 1 else 0)
            fit = int(budget // layer)
            take = min(max(1, fit), remaining - stage)  # leave one layer for each earlier stage
            if take < 1 or take * layer + (last_extra if stage == n_stages - 1 else 0) > limit + 1e-9:
                return None
            counts.append(take)
            remaining -= take
        return counts[::-1] if remaining == 0 else None

    # The best limit is one of the finitely many stage costs: k layers (+ output on the last stage).
    candidates = sorted({k * layer for k in range(1, n_layers + 1)}
                        | {k * layer + last_extra for k in range(1, n_layers + 1)})
    for limit in candidates:
        counts = stages_needed(limit)
        if counts is not None:
            return counts
    raise ValueError(f"cannot split {n_layers} layers into {n_stages} stages")


def parse_layer_counts(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def layers_per_stage(cfg: ModelConfig, n_stages: int, pp_layers: str) -> list[list[int]]:
    """Layer indices of each stage, from `parallel.pp_layers` or the balanced split."""
    counts = parse_layer_counts(pp_layers) if pp_layers else balanced_layer_counts(cfg, n_stages)
    out, start = [], 0
    for count in counts:
        out.append(list(range(start, start + count)))
        start += count
    return out
