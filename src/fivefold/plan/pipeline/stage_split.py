"""Cutting the model into pipeline stages: which layers each stage holds and which rank runs it.

Pure arithmetic (no process groups), so validation, the planner and the rank map can use it.
"""

from __future__ import annotations

from fivefold.config import ModelConfig
from fivefold.config.schedules import V_SCHEDULES, parse_layer_counts


def stage_to_rank(stage: int, pp: int, schedule: str) -> int:
    n_stages = 2 * pp if schedule in V_SCHEDULES else None
    if n_stages is not None:
        return stage if stage < pp else n_stages - 1 - stage
    return stage % pp  # loop: rank r runs stages r, r+pp, r+2·pp, ...


def stages_of_rank(rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    return [s for s in range(pp * virtual) if stage_to_rank(s, pp, schedule) == rank]


def stage_costs(model: ModelConfig, seq_len: int) -> tuple[list[float], float]:
    """FLOPs per token of each layer (MoE layers: the experts a token visits; attention grows with
    the sequence) and of what the last stage runs after them (the output layer, multi-token
    prediction). This is the planner's cost model, so training cuts the model exactly where the
    planner's predictions assume."""
    from fivefold.plan.model_stats import model_stats  # pure arithmetic on the config

    stats = model_stats(model)
    return ([stats.layer_flops_per_token(i, seq_len) for i in range(model.n_layers)],
            stats.head_flops_per_token(seq_len))


def balanced_layer_counts(costs: list[float], head: float, n_stages: int) -> list[int]:
    """Contiguous layer counts per stage, the last stage also carrying `head` (the output layer,
    the most expensive single block of a large-vocabulary model; the embedding lookup costs next
    to nothing). Each stage takes layers until it reaches an even share of what is left, rounding
    to the nearest layer, and leaves at least one layer for every later stage."""
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} layers into {n_stages} stages")
    remaining = sum(costs) + head
    counts, i = [], 0
    for stage in range(n_stages - 1):
        share = remaining / (n_stages - stage)
        last_allowed = n - (n_stages - stage - 1)
        taken, count = 0.0, 0
        while i < last_allowed and (count == 0 or taken + costs[i] / 2 <= share):
            taken += costs[i]
            count += 1
            i += 1
        counts.append(count)
        remaining -= taken
    counts.append(n - i)
    return counts


def layers_per_stage(cfg: ModelConfig, n_stages: int, pp_layers: str, seq_len: int) -> list[list[int]]:
    """Layer indices of each stage, from `parallel.pp_layers` or the balanced split."""
    counts = parse_layer_counts(pp_layers) if pp_layers else balanced_layer_counts(
        *stage_costs(cfg, seq_len), n_stages)
    out, start = [], 0
    for count in counts:
        out.append(list(range(start, start + count)))
        start += count
    return out
