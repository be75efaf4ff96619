"""Which pipeline ranks a step's time and memory are computed for: ranks alike in what a micro-batch
costs are timed once (a 32-stage pipeline has a handful of compositions), the rank holding the most
parameters, and the most weights any rank holds whole with partial-sum gradients. Memoised per
model and pipeline: a search asks the same for every ZeRO stage and recomputation setting."""

from __future__ import annotations

from functools import lru_cache

from fivefold.plan.layout import Layout
from fivefold.plan.memory.peak import rank_param_counts
from fivefold.plan.pipeline.schedule import PipelineRank


@lru_cache(maxsize=4096)
def distinct_compositions(stats, ranks: tuple) -> tuple:
    """One pipeline rank of each composition, the first of each: a micro-batch's time depends on a
    rank's ends and how many layers of each kind it holds, not on which, so ranks alike are timed
    once (a 32-stage pipeline has a handful of compositions). Once per pipeline (`ranks` hashes once)."""
    composition = {(p.has_embedding, p.has_output,
                    tuple((stats.is_moe(i), i in stats.sliding_layers, i >= stats.n_layers, n) for i, n in p.kinds)): p
                   for p in reversed(ranks)}
    return tuple(composition.values())


@lru_cache(maxsize=4096)
def heaviest_rank(stats, tp: int, ep: int, ranks: tuple) -> PipelineRank:
    """The pipeline rank with the most parameters (the first of those), by the degrees that split them."""
    layout = Layout(tp=tp, ep=ep)
    return max(ranks, key=lambda p: sum(rank_param_counts(stats, layout, p)))


@lru_cache(maxsize=4096)
def most_partial_weights(stats, ranks: tuple, moe_partial: float, mtp_partial: float) -> float:
    """The most weights any rank holds whole on every tp rank with partial-sum gradients."""
    return max(len(p.layers) * stats.latent_params + p.moe_layers * moe_partial + p.has_output * mtp_partial
               for p in ranks)
