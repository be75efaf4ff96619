"""How fast a layer's matmuls run on a GPU, by their shapes: the share of peak its GEMMs reach.

A GEMM of m x k by k x n (2mnk FLOPs) takes
    max(2mnk / (peak x matmul_efficiency), bytes moved / HBM bandwidth) + gemm_fill_s
  - matmul_efficiency: the share of the dense peak a large GEMM sustains inside a training step
    (Hardware; below a microbenchmark's because clocks fall under a training step's power draw);
  - the memory roofline: a skinny GEMM (a few rows per expert, a narrow tp shard) is bound by
    reading its operands, not by the tensor cores;
  - gemm_fill_s: the ramp-up and tail of one kernel (the first wave of tiles filling the SMs, the
    K-loop's prologue, the epilogue and the last partial wave), about one wave's work; it is what
    makes a 1024^3 GEMM reach a quarter of peak and an 8192^3 one nearly all of matmul_efficiency
    (NVIDIA, "Matrix Multiplication Background User's Guide": tile and wave quantization).
A layer's efficiency is its GEMMs' FLOPs over their summed time, so it grows with the GEMM sizes:
a wider model, more tokens per micro-batch, a smaller tp shard.

FP8 (train.fp8) GEMMs run at `fp8_peak_ratio` x the bf16 peak times the runtime's
float8_linear_speedup / fp8_peak_ratio (the FP8 rate a large GEMM reaches over bf16), and each
operand is first scaled and cast (Runtime.float8_cast_bytes_per_element of memory traffic per
element): large GEMMs gain nearly the whole rate, small ones little.

MoE experts run as one grouped GEMM: each local expert's rows are padded to the M tile (128)
(expected_padded_rows: the counts vary from micro-batch to micro-batch), and the expert weights are
read whatever the rows, so small experts with few tokens each are bound by the tile padding and the
memory roofline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

M_TILE = 128  # rows of one CTA tile of a grouped GEMM (CUTLASS / cuBLAS grouped kernels, Hopper and Ampere)


@dataclass(frozen=True)
class Gemm:
    m: float  # rows (tokens)
    n: float
    k: float
    count: int = 1  # identical GEMMs (separate kernels)
    groups: int = 1  # experts of one grouped kernel (rows per group: m)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count * self.groups


@lru_cache(maxsize=4096)
def expected_padded_rows(mean_rows: float) -> float:
    """An expert's rows padded to the M tile, on average over micro-batches: routing draws each
    expert's count at random around its mean (variance about the mean, as for a Poisson count), so
    the padding is the expected number of started tiles, sum over j >= 0 of P(rows > j M_TILE),
    not that of the mean count (which has none at an exact multiple of the tile and a whole tile
    just above one)."""
    sigma = math.sqrt(max(mean_rows, 1.0))
    tiles = 1.0 - math.exp(-mean_rows)  # P(rows > 0), Poisson
    j = 1
    while j * M_TILE < mean_rows + 8 * sigma:
        tiles += 0.5 * math.erfc((j * M_TILE + 0.5 - mean_rows) / (sigma * math.sqrt(2.0)))
        j += 1
    return tiles * M_TILE


def gemm_seconds(g: Gemm, hw, speedup: float = 1.0, cast_bytes: float = 0.0, operand_bytes: float = 2.0) -> float:
    """One pass (forward, or one of the two backward GEMMs) of g on hw. speedup: the FP8 rate over
    bf16 (1 for bf16); cast_bytes: memory traffic per operand element spent scaling and casting."""
    rate = hw.peak_flops * hw.matmul_efficiency * speedup
    padded_rows = expected_padded_rows(g.m) if g.groups > 1 else g.m
    compute = 2.0 * padded_rows * g.n * g.k * g.groups / rate
    moved = operand_bytes * g.groups * (g.m * g.k + g.k * g.n) + 2.0 * g.groups * g.m * g.n
    memory = moved / hw.hbm_bw
    cast = cast_bytes * g.groups * (g.m * g.k + g.k * g.n) / hw.hbm_bw
    return g.count * (max(compute, memory) + hw.gemm_fill_s + cast)


def efficiency(gemms: tuple[Gemm, ...], hw, speedup: float = 1.0, cast_bytes: float = 0.0) -> float:
    """The share of hw.peak_flops these GEMMs reach together (FLOPs over time)."""
    flops = sum(g.flops for g in gemms)
    if flops <= 0:
        return hw.matmul_efficiency
    operand = 1.0 if speedup > 1.0 else 2.0
    seconds = sum(gemm_seconds(g, hw, speedup, cast_bytes, operand) for g in gemms)
    return flops / seconds / hw.peak_flops


@lru_cache(maxsize=8192)
def layer_gemms(stats, moe: bool, tokens: float, tp: int, ep: int,
                imbalance: float = 1.0) -> tuple[tuple[Gemm, ...], tuple[Gemm, ...]]:
    """(dense-projection GEMMs, expert GEMMs) of one layer for `tokens` rows on one tp rank.

    Attention: q, k, v and the output projection, split by heads over tp. A dense MLP: its up
    matrices (gate and up for SwiGLU) and down, split over tp. A MoE layer routes each tp rank's
    1/tp of the tokens (parallel/tensor/apply.py): the shared experts see those rows, and each of
    the n_experts / ep local experts gets ep x rows x top_k / n_experts of them on average,
    `imbalance` times that on the busiest ep rank (plan/speed/expert_load.py)."""
    h = stats.dim
    dense = [Gemm(tokens, stats.q_dim / tp, h), Gemm(tokens, stats.kv_dim / tp, h),
             Gemm(tokens, stats.v_dim / tp, h), Gemm(tokens, h, stats.o_dim / tp)]
    experts: list[Gemm] = []
    if not moe:
        up = stats.mlp_matrices - 1
        dense += [Gemm(tokens, stats.ffn_dim / tp, h, count=up), Gemm(tokens, h, stats.ffn_dim / tp)]
    else:
        rows = tokens / tp
        if stats.shared_expert_params:
            width = stats.shared_expert_params / (3 * h)
            experts += [Gemm(rows, width, h, count=2), Gemm(rows, h, width)]
        if stats.n_experts:
            local = max(1, stats.n_experts // ep)
            per_expert = max(1.0, imbalance * ep * rows * stats.top_k / stats.n_experts)
            width = stats.expert_hidden
            experts += [Gemm(per_expert, 2 * width, h, groups=local), Gemm(per_expert, h, width, groups=local)]
    return tuple(dense), tuple(experts)


@lru_cache(maxsize=8192)
def layer_efficiencies(stats, moe: bool, tokens: float, tp: int, ep: int, hw, fp8_speedup: float,
                       cast_bytes: float, imbalance: float = 1.0) -> tuple[float, float, float]:
    """(bf16 dense-projection, FP8 dense-projection, expert) efficiency of one layer's GEMMs. The
    experts' is the mean load's FLOPs over the busiest ep rank's time, which every rank waits for."""
    dense, experts = layer_gemms(stats, moe, tokens, tp, ep)
    expert_eff = hw.matmul_efficiency
    if experts:
        busiest = layer_gemms(stats, moe, tokens, tp, ep, imbalance)[1] if imbalance != 1.0 else experts
        expert_eff = efficiency(busiest, hw) * sum(g.flops for g in experts) / sum(g.flops for g in busiest)
    return efficiency(dense, hw), efficiency(dense, hw, fp8_speedup, cast_bytes), expert_eff


@lru_cache(maxsize=2048)
def output_efficiency(stats, tokens: float, tp: int, hw) -> float:
    """The output projection: tokens x dim by dim x vocab/tp."""
    return efficiency((Gemm(tokens, stats.vocab_size / tp, stats.dim),), hw)
