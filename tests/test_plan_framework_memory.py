"""Memory as each framework holds it (issue 53, plan/memory/framework.py): the gradient buffer's
dtype, the process's fixed costs, the device's capacity in GiB; and the attention kernel's rate."""

from __future__ import annotations

import dataclasses

import pytest

from fivefold.config import ModelConfig
from fivefold.config.schema import MoEConfig
from fivefold.plan.memory.activations import layer_activation_bytes
from fivefold.plan.speed.attention import attention_seconds
from fivefold.plan.estimate import estimate
from fivefold.plan.memory.framework import communicators, process_bytes
from fivefold.plan.hardware import PROFILES, hardware_for
from fivefold.plan.speed.frameworks import FIVEFOLD_EAGER, MEGATRON_2022_RUNTIME, MEGATRON_RUNTIME
from fivefold.plan.layout import Layout
from fivefold.plan.memory.peak import rank_memory
from fivefold.plan.model_stats import model_stats
from fivefold.plan.pipeline.schedule import in_flight_per_chunk, pipeline_ranks
from fivefold.plan.workload import PRECISIONS, Workload

GiB = 2 ** 30


def _work():
    model = ModelConfig(preset="llama3-8b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                        vocab_size=128256, max_seq_len=8192, tie_embeddings=False)
    return Workload(stats=model_stats(model), seq_len=8192, global_batch=64, precision=PRECISIONS["bf16"])


def test_megatron_keeps_bf16_gradients_where_fivefold_keeps_fp32():
    work, layout, hw = _work(), Layout(dp=8, zero=1, mbs=1), hardware_for("h100")
    st = work.stats
    weights = (st.n_layers * (st.attention_params + st.norm_params + st.dense_mlp_params)
               + 2 * st.vocab_size * st.dim + st.dim)  # untied embedding and output, final norm
    fivefold = estimate(work, layout, hw, FIVEFOLD_EAGER).memory
    megatron = estimate(work, layout, hw, MEGATRON_RUNTIME).memory
    # grad_reduce_in_fp32 = False: 2 bytes per weight, whole under the distributed optimizer
    assert megatron.grads == pytest.approx(fivefold.grads / 2)
    assert megatron.grads == pytest.approx(2 * weights, rel=1e-6)
    # the optimizer's fp32 master and moments are the same 12 bytes over dp
    assert megatron.optimizer == pytest.approx(fivefold.optimizer)
    # A100-era Megatron-LM (megatron-2022) keeps the recipe's fp32 buffer
    assert estimate(work, layout, hw, MEGATRON_2022_RUNTIME).memory.grads == pytest.approx(fivefold.grads)


def test_bf16_optimizer_state_keeps_masters_and_moments_at_2_bytes():
    """NeMo's Apex DistributedFusedAdam with optim.dtype = bf16 (the Nemotron-4 340B benchmark):
    both Adam moments in bf16 and no master copy (store_params = False: the optimizer's dtype is the
    weights'), 4 bytes per weight over dp instead of 12; weights, gradients and activations as
    before."""
    work, layout, hw = _work(), Layout(dp=8, zero=1, mbs=1), hardware_for("h100")
    fp32 = estimate(work, layout, hw, MEGATRON_RUNTIME).memory
    bf16 = estimate(work, layout, hw, dataclasses.replace(MEGATRON_RUNTIME, optimizer_state_bytes=2.0)).memory
    assert bf16.optimizer == pytest.approx(fp32.optimizer / 3)
    assert (bf16.params, bf16.grads, bf16.activations) == (fp32.params, fp32.grads, fp32.activations)
    # fp32 state stated explicitly is the default
    same = estimate(work, layout, hw, dataclasses.replace(MEGATRON_RUNTIME, optimizer_state_bytes=4.0)).memory
    assert same.optimizer == pytest.approx(fp32.optimizer)


def test_the_command_line_sets_the_optimizer_state_dtype(capsys):
    import json

    from fivefold.plan.cli import run_plan

    argv = ["--model.preset", "llama3-8b", "--train.dtype", "bf16", "--train.seq_len", "4096",
            "--model.max_seq_len", "4096", "--train.global_batch", "64", "--cluster.gpu", "h100",
            "--layout", "dp=8,tp=1,pp=1,zero=1,mbs=1", "--framework", "megatron", "--json"]
    optimizer = {}
    for state in ("fp32", "bf16"):
        assert run_plan(argv + ["--optimizer-state-dtype", state]) == 0
        optimizer[state] = json.loads(capsys.readouterr().out)["candidates"][0]["memory_bytes"]["optimizer"]
    assert optimizer["bf16"] == pytest.approx(optimizer["fp32"] / 3, rel=1e-6)
    assert run_plan(argv + ["--optimizer-state-dtype", "fp16"]) == 2
    assert "--optimizer-state-dtype 'fp16' is not one of fp32, bf16" in capsys.readouterr().err


def test_fixed_costs_count_the_context_and_each_communicator():
    hw = hardware_for("h100")
    assert communicators(Layout(dp=1)) == 0
    assert communicators(Layout(dp=4, tp=2, pp=2)) == 3  # dp, tp, pp
    assert communicators(Layout(dp=4, cp=2)) == 2  # cp, and the gradients over dp x cp
    assert process_bytes(Layout(dp=4, tp=2, pp=2), hw) == pytest.approx(0.5 * GiB + 3 * 0.25 * GiB)
    # on the CPU (gloo) there is neither
    assert process_bytes(Layout(dp=4, tp=2, pp=2), PROFILES["cpu"]) == 0
    mem = estimate(_work(), Layout(dp=4, tp=2, zero=1), hw, FIVEFOLD_EAGER).memory
    assert mem.total - mem.allocated == pytest.approx(0.5 * GiB + 2 * 0.25 * GiB)


def test_capacity_is_what_the_driver_reports():
    # nvidia-smi's totals: the "80 GB" H100 holds 81,559 MiB, more than 80e9 bytes
    assert PROFILES["h100"].memory_bytes == 81559 * 2 ** 20 > 80e9
    assert PROFILES["a100"].memory_bytes == 80 * GiB
    assert PROFILES["b200"].memory_bytes == 183359 * 2 ** 20


def test_attention_core_time_follows_the_kernel_rate():
    stats, hw = _work().stats, hardware_for("h100")
    fa2 = attention_seconds(stats, 0, 8192, 8192, hw, "fused", "none", 0.5)
    te = attention_seconds(stats, 0, 8192, 8192, hw, "fused", "none", 0.7)
    assert te == pytest.approx(fa2 * 0.5 / 0.7)
    # 0.5 on half the square is the full square at the GEMM rate (what the torch stacks were fitted with)
    flops = stats.layer_attention_flops_per_token(0, 8192) * 8192
    assert fa2 == pytest.approx(flops / (hw.peak_flops * hw.matmul_efficiency))
    assert MEGATRON_RUNTIME.attention_rate > FIVEFOLD_EAGER.attention_rate == 0.5


def test_a_stack_rate_scales_the_gemms_and_not_the_memory():
    work, layout, hw = _work(), Layout(dp=8, zero=1, mbs=1), hardware_for("h100")
    slow = estimate(work, layout, hw, dataclasses.replace(MEGATRON_RUNTIME, matmul_rate=1.0))
    fast = estimate(work, layout, hw, dataclasses.replace(MEGATRON_RUNTIME, matmul_rate=1.2))
    assert fast.time_parts["compute"] < slow.time_parts["compute"]
    assert fast.memory.total == slow.memory.total
    assert fast.memory_limit == slow.memory_limit == hw.memory_bytes


def test_megatron_s_selective_recomputation_is_the_attention_core_only():
    work, hw = _work(), hardware_for("h100")
    none, selective = (Layout(dp=4, tp=2, zero=1, mbs=1, sp=True, recompute=r) for r in ("none", "selective"))
    # Megatron recomputes the core attention only; a fused kernel keeps no scores: what 'none' keeps and costs
    mega = estimate(work, selective, hw, MEGATRON_RUNTIME)
    assert mega.memory.total == estimate(work, none, hw, MEGATRON_RUNTIME).memory.total
    assert mega.step_time_s == estimate(work, none, hw, MEGATRON_RUNTIME).step_time_s
    assert mega.layout.recompute == "selective"  # the answer names the layout as given
    # fivefold's selective recomputes norms and activations (and branches): less memory than none
    assert (estimate(work, selective, hw, FIVEFOLD_EAGER).memory.activations
            < estimate(work, none, hw, FIVEFOLD_EAGER).memory.activations)


def test_megatron_frees_each_sent_stage_output():
    work, hw = _work(), hardware_for("h100")
    layout = Layout(dp=2, pp=4, tp=2, sp=True, zero=1, mbs=1, pp_schedule="interleaved_1f1b", pp_virtual=2)
    m = layout.micro_batches(work.global_batch)
    prank = pipeline_ranks(work.stats, layout, work.seq_len)[0]
    keeps = dataclasses.replace(MEGATRON_RUNTIME, frees_sent_outputs=False)
    kept = rank_memory(work, layout, hw, keeps, prank, 0).activations
    freed = rank_memory(work, layout, hw, MEGATRON_RUNTIME, prank, 0).activations
    # deallocate_output_tensor: each in-flight micro-batch's output of every sending chunk, bf16,
    # its 1/tp of the sequence, is what fivefold keeps and Megatron does not
    sent = sum(n for n, sends in zip(in_flight_per_chunk(layout, 0, m), prank.sends) if sends)
    assert sent > 0
    assert kept - freed == pytest.approx(sent * work.seq_len * work.stats.dim / 2 * 2)


def test_megatron_s_routed_copies_keep_input_fc1_and_weighted_activation():
    model = ModelConfig(dim=2880, n_layers=4, n_heads=64, n_kv_heads=8, ffn_dim=2880, vocab_size=32000,
                        max_seq_len=4096, moe=MoEConfig(n_experts=128, top_k=4, expert_ffn_dim=2880))
    work = Workload(stats=model_stats(model), seq_len=4096, global_batch=64, precision=PRECISIONS["bf16"])
    layout, hw = Layout(dp=8, ep=8, zero=1, mbs=1), hardware_for("b200")
    moe = next(i for i in range(4) if work.stats.is_moe(i))
    per_token = {rt.name: layer_activation_bytes(work, moe, layout, "none", hw, rt, imbalance=1.0)
                 for rt in (FIVEFOLD_EAGER, MEGATRON_RUNTIME)}
    h, k = work.stats.dim, work.stats.top_k
    # fivefold keeps 3h + 3f per copy (dispatched, combined, weighted; SwiGLU), Megatron h + 3f
    assert per_token["fivefold-eager"] - per_token["megatron"] == pytest.approx(k * 2 * h * 2)


def test_only_fivefold_s_output_layer_keeps_no_logits():
    work, hw, layout = _work(), hardware_for("h100"), Layout(dp=8, zero=1, mbs=1)
    prank = pipeline_ranks(work.stats, layout, work.seq_len)[0]
    fused = rank_memory(work, layout, hw, FIVEFOLD_EAGER, prank, 0)
    kept = rank_memory(work, layout, hw, dataclasses.replace(FIVEFOLD_EAGER, fuses_output_loss=False), prank, 0)
    # models/loss/linear_cross_entropy.py: no bf16 logits (2 bytes x vocab per token) are kept; its
    # backward sums the output weight's gradient in fp32 instead (working memory)
    assert kept.activations - fused.activations == pytest.approx(work.seq_len * 2 * work.stats.vocab_size, rel=1e-3)
    assert fused.other - kept.other == pytest.approx(4 * work.stats.vocab_size * work.stats.dim)
    assert not (MEGATRON_RUNTIME.fuses_output_loss or MEGATRON_2022_RUNTIME.fuses_output_loss)
