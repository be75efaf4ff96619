"""How unevenly routed tokens land on the expert-parallel ranks, and what the busiest rank costs.

An MoE layer's ep ranks exchange tokens, each runs its experts on what it received, and all wait
for the slowest at the combine: the layer's expert GEMMs and its all-to-all take as long as the
busiest rank's rows, `imbalance` times the mean (the trainer's `moe_rank_imbalance` metric is this
ratio, measured: parallel/expert/apply.py).

Without a measured value the planner takes the least a step can have: a router whose expected load
is even still draws each micro-batch's tokens at random. With R = rows x top_k assignments
expected per rank, E experts, ep ranks, a rank's count is a sum of per-token hypergeometric draws
(top_k distinct experts of E, E/ep of them local) whose variance is R (1 - 1/ep) (E - k)/(E - 1);
the counts sum to the total, so they move as sqrt(R (E - k)/(E - 1)) (Z_j - mean Z) with Z_j
independent standard normals, and the expected busiest rank is
    imbalance = 1 + z(ep) sqrt((E - k) / ((E - 1) R)),    z(n) = E[max of n standard normals].
A router that prefers some experts adds to this (the measured figure says how much); a capacity
factor caps it, since no expert takes more than capacity_factor x its mean share
(models/moe/capacity.py drops the rest).
"""

from __future__ import annotations

import math
from functools import lru_cache


@lru_cache(maxsize=256)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1), by integrating x d(Phi(x)^n)."""
    if n <= 1:
        return 0.0
    step, total = 0.005, 0.0
    previous = 0.0  # Phi(-10)^n
    for i in range(1, 4001):
        x = -10.0 + i * step
        current = (0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))) ** n
        total += (x - step / 2) * (current - previous)
        previous = current
    return total


def routing_noise_imbalance(rows: float, top_k: int, n_experts: int, ep: int) -> float:
    """The expected busiest-rank load over the mean for a router balanced in expectation (docstring):
    `rows` tokens routed by each of the `ep` ranks, each to `top_k` of `n_experts` experts."""
    if ep <= 1 or n_experts <= top_k or rows <= 0:
        return 1.0
    per_rank = rows * top_k  # assignments a rank receives on average
    return 1.0 + expected_max_normal(ep) * math.sqrt((n_experts - top_k) / ((n_experts - 1) * per_rank))


def rank_imbalance(workload, layout) -> float:
    """The busiest ep rank's routed rows over the mean, for one MoE layer of one micro-batch:
    workload.moe_rank_imbalance (measured: the trainer's moe_rank_imbalance) when given, else the
    routing noise of the rows each rank routes (its micro-batch's tokens, split over cp and, in MoE
    layers, over tp: parallel/tensor/apply.py); at most model.moe.capacity_factor when one is set.
    1 without expert parallelism (every rank runs every expert on its own tokens)."""
    stats = workload.stats
    if layout.ep <= 1 or not stats.n_experts:
        return 1.0
    rows = layout.mbs * workload.seq_len / layout.cp / layout.tp
    imbalance = workload.moe_rank_imbalance or routing_noise_imbalance(rows, stats.top_k, stats.n_experts, layout.ep)
    return min(imbalance, workload.capacity_factor) if workload.capacity_factor else imbalance
