"""FLOPs per token a prediction counts: the matmuls train.fp8 runs in FP8, and the model FLOPs of
the one MFU formula (ModelStats.mfu)."""

from __future__ import annotations

from functools import lru_cache

from fivefold.models.block_weights import adapter_params_per_token


def float8_flops_per_token(stats, groups, seq: int) -> float:
    """The matmul FLOPs train.fp8 runs in FP8 (parallel/float8.py): the layers' dense projections,
    not attention's score and value products, the MoE layers (router, experts), MLA's latent
    down-projections, multi-token prediction's eh_proj or the output layer."""
    total = 0.0
    for layer, count in groups:
        flops = (stats.layer_flops_per_token(layer, seq) - stats.layer_attention_flops_per_token(layer, seq)
                 - stats.moe_flops_per_token(layer) - 6.0 * stats.latent_params)
        if layer >= stats.n_layers:  # a multi-token-prediction block: its output layer and eh_proj
            flops -= stats.output_flops_per_token + 12.0 * stats.dim * stats.dim
        total += count * max(0.0, flops)
    return total


@lru_cache(maxsize=256)
def model_flops_per_token(stats, seq_len: int, lora) -> float:
    """The model FLOPs of ModelStats.mfu (the one MFU formula: tokens/s x this / peak), a sum over
    every layer: computed once per model, sequence and LoRA, not for each of a search's layouts."""
    adapters = adapter_params_per_token(stats, lora.rank, lora.targets) if lora.rank else None
    return stats.mfu(seq_len, 1.0, 1.0, adapters)  # x 1 and / 1 are exact: the FLOPs themselves
