"""The gradient-accumulation pass in the planner's time model (issue 41, plan/speed/grad_accum.py): per
micro-batch, a memory-bound pass over the weights a rank trains, priced as the framework runs it.
Pure arithmetic on constructed cases; no timing asserts."""

from __future__ import annotations

import dataclasses

import pytest

from fivefold.config import ModelConfig
from fivefold.plan.estimate import estimate
from fivefold.plan.speed.grad_accum import accumulation_bytes_per_weight
from fivefold.plan.hardware import hardware_for
from fivefold.plan.speed.frameworks import FIVEFOLD_EAGER, MEGATRON_2022_RUNTIME
from fivefold.plan.layout import Layout
from fivefold.plan.lora import Lora, adapter_param_counts
from fivefold.plan.memory.peak import rank_param_counts
from fivefold.plan.model_stats import model_stats
from fivefold.plan.pipeline.schedule import pipeline_ranks
from fivefold.plan.workload import PRECISIONS, Workload

A100 = hardware_for("a100")
FUSED = dataclasses.replace(FIVEFOLD_EAGER, grad_accum="fused")
AUTOGRAD = dataclasses.replace(FIVEFOLD_EAGER, grad_accum="autograd")


def _workload(precision="bf16", batch=16, lora=Lora()):
    model = ModelConfig(dim=4096, n_layers=8, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                        max_seq_len=2048)
    return Workload(stats=model_stats(model), seq_len=2048, global_batch=batch,
                    precision=PRECISIONS[precision], lora=lora)


def _extra_compute(work, layout, runtime) -> float:
    """Seconds per step the pass adds: the step's compute less that of the same step with the pass
    fused into the weight-gradient GEMM (m micro-batches on the one pipeline rank)."""
    return (estimate(work, layout, A100, runtime).time_parts["compute"]
            - estimate(work, layout, A100, FUSED).time_parts["compute"])


@pytest.mark.parametrize("precision,zero,runtime,per_weight", [
    ("bf16", 1, FIVEFOLD_EAGER, lambda m, shard: 2 + 4 + 4),  # hook: read bf16, read + write fp32
    ("bf16", 0, FIVEFOLD_EAGER, lambda m, shard: 10),
    ("fp32", 1, FIVEFOLD_EAGER, lambda m, shard: 12 * (m - 1) / m),  # autograd adds in place after the first
    ("bf16", 3, FIVEFOLD_EAGER, lambda m, shard: 12 * (m - 1) / m / shard),  # FSDP2: into the fp32 shard
    ("fp32", 3, FIVEFOLD_EAGER, lambda m, shard: 12 * (m - 1) / m / shard),
    ("bf16", 1, AUTOGRAD, lambda m, shard: 6 * (m - 1) / m),  # DeepSpeed: 16-bit .grad in place
])
def test_each_micro_batch_passes_over_the_trained_weights(precision, zero, runtime, per_weight):
    work, layout = _workload(precision), Layout(dp=4, zero=zero, mbs=1)
    m = layout.micro_batches(work.global_batch)
    weights = sum(rank_param_counts(work.stats, layout, pipeline_ranks(work.stats, layout, 2048)[0]))
    expected = m * weights * per_weight(m, layout.shard_degree) / A100.hbm_bw
    assert expected > 0
    assert _extra_compute(work, layout, runtime) == pytest.approx(expected, rel=1e-9)


def test_megatron_fuses_it_and_lora_passes_over_the_adapters_only():
    work, layout = _workload(), Layout(dp=4, zero=1, mbs=1)
    assert accumulation_bytes_per_weight(work.precision, layout, MEGATRON_2022_RUNTIME, 4) == 0.0
    lora = _workload(lora=Lora(16, "attention|mlp", 0.0))
    m = layout.micro_batches(lora.global_batch)
    adapters = sum(adapter_param_counts(lora.stats, layout, pipeline_ranks(lora.stats, layout, 2048)[0], lora.lora))
    assert _extra_compute(lora, layout, FIVEFOLD_EAGER) == pytest.approx(m * adapters * 10 / A100.hbm_bw, rel=1e-9)
    assert _extra_compute(lora, layout, FIVEFOLD_EAGER) < 0.05 * _extra_compute(work, layout, FIVEFOLD_EAGER)


def test_the_pass_weighs_most_where_a_rank_holds_many_weights_for_few_tokens():
    """Its share of the step grows with the weights per token of a micro-batch: one 2048-token
    sequence per micro-batch against eight, on the same rank."""
    def share(mbs):
        work, layout = _workload(batch=64), Layout(dp=4, zero=1, mbs=mbs)
        return _extra_compute(work, layout, FIVEFOLD_EAGER) / estimate(work, layout, A100, FIVEFOLD_EAGER).step_time_s
    assert share(1) > 4 * share(8) > 0


def test_under_a_pipeline_fsdp2_accumulates_whole_fp32_gradients():
    """PyTorch's pipeline stage reduce-scatters once a step: FSDP2 upcasts the first micro-batch's
    whole bf16 gradient (2 + 4 bytes a weight) and adds the later ones into it (2 + 4 + 4)."""
    work, layout = _workload(batch=32), Layout(dp=2, pp=2, zero=3, mbs=1)
    m = layout.micro_batches(work.global_batch)
    assert accumulation_bytes_per_weight(work.precision, layout, FIVEFOLD_EAGER, m) == pytest.approx(
        (6 + 10 * (m - 1)) / m)
    assert accumulation_bytes_per_weight(PRECISIONS["fp32"], layout, FIVEFOLD_EAGER, m) == pytest.approx(12 * (m - 1) / m)
