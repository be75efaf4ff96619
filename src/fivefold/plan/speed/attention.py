"""How long a layer's attention core (scores, softmax, weighted values) takes, by kernel kind.

'fused' (FlashAttention, cuDNN/TE fused attention, PyTorch SDPA): one kernel per pass whose score
and value products run at the GPU's matmul efficiency; no s x s score matrix touches memory.

'unfused' (Megatron-LM's core attention of 2021-22, Narayanan et al. 2021 and Korthikanti et al.
2022, before FlashAttention): per (sequence, head) the scores q k^T and the weighted values p v
are batched GEMMs with one small dimension (the head dim), and the s x s scores go through memory
between them: the fused scale-mask-softmax kernel and dropout (Korthikanti et al. s4.1: the
"5as/h" of their activation count is those tensors: softmax output 2, dropout mask 1, dropout
output 2 bytes per score element). Selective recomputation (Korthikanti s4.2) runs this core's
forward once more in backward instead of keeping those tensors.
"""

from __future__ import annotations

from functools import lru_cache

from fivefold.plan.speed import gemm

# Bytes of memory traffic per score element in the unfused core's elementwise kernels (16-bit
# scores): forward softmax reads 2 writes 2, dropout reads 2 writes 2 and a 1-byte mask (9);
# backward dropout reads 2 + mask 1 and writes 2, softmax backward reads the gradient and its
# output (4) and writes 2 (11).
UNFUSED_FORWARD_BYTES = 9.0
UNFUSED_BACKWARD_BYTES = 11.0


@lru_cache(maxsize=1024)
def _unfused_gemm_efficiency(seq: int, head_dim: int, heads: int, hw) -> float:
    """Share of peak of the core's batched GEMMs: q k^T (s x d by d x s, writing s x s) and p v
    (s x s by s x d), one kernel each over `heads` (sequence, head) pairs."""
    gemms = (gemm.Gemm(seq, seq, head_dim, groups=heads), gemm.Gemm(seq, head_dim, seq, groups=heads))
    return gemm.efficiency(gemms, hw)


# A causal fused kernel skips the tiles above the diagonal: it runs half the square's FLOPs.
CAUSAL_SHARE = 0.5


def attention_seconds(stats, layer: int, seq: int, rows: float, hw, kernel: str,
                      recompute: str, rate: float = 0.5) -> float:
    """Seconds of one layer's attention core, forward + backward (+ recomputation), for `rows`
    query tokens' share of the heads (tokens on this rank / tp: rows x n_heads head-rows). rate:
    a fused kernel's rate over a large GEMM's on the FLOPs it runs (Runtime.attention_rate)."""
    flops = stats.layer_attention_flops_per_token(layer, seq)  # forward + backward, full square
    again = 4 / 3 if recompute == "full" else 1.0
    if kernel != "unfused":
        return again * CAUSAL_SHARE * flops * rows / (hw.peak_flops * hw.matmul_efficiency * rate)
    keys = min(seq, stats.sliding_window) if layer in stats.sliding_layers else seq
    heads = max(1, round(rows * stats.n_heads / seq))  # (sequence, head) pairs of one batched kernel
    eff = _unfused_gemm_efficiency(keys, stats.head_dim, heads, hw)
    # Without full recomputation Megatron recomputes the core's forward (selective recomputation):
    # one more forward of its GEMMs and elementwise kernels either way.
    matmul = (4 / 3) * flops * rows / (hw.peak_flops * eff)
    scores = rows * stats.n_heads * keys  # score elements of this rank's heads
    traffic = scores * (2 * UNFUSED_FORWARD_BYTES + UNFUSED_BACKWARD_BYTES)
    return matmul + traffic / hw.hbm_bw
