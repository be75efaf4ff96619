"""The runtime profiles of the stacks the planner prices (plan/hardware.py Runtime: what each
field is physically): fivefold eager and compiled, and the frameworks published runs were made
with, so that a prediction of a published run is made as that framework runs it. Each profile says
what its stack overlaps (`overlaps`); the fitted constants come from plan/fitted.py.
"""

from __future__ import annotations

import dataclasses

from fivefold.plan import fitted
from fivefold.plan.hardware import Runtime


# fivefold eager: calibrated on torchtitan's bf16/FP8 runs (8-512 H100s), the PyTorch-native
# stack fivefold is built from (plan/fitted.py).
FIVEFOLD_EAGER = Runtime(fuses_output_loss=True)
# fivefold with train.compile: Inductor fuses the elementwise chains (fewer passes over memory,
# fewer and longer kernels).
FIVEFOLD_COMPILED = dataclasses.replace(FIVEFOLD_EAGER, elementwise_passes=fitted.COMPILED_ELEMENTWISE_PASSES,
                                        kernels_per_layer=40, regathers_inputs=False, name="fivefold-compiled")
DEFAULT_RUNTIME = FIVEFOLD_EAGER
# The Playbook's runs were made with nanotron: its activations, async TP linear (part of the tp
# traffic hidden), fp32 gradient buffers (filled by hooks, as fivefold's) reduced after the last
# backward, and its own host costs (fitted on playbook_runs_dev.csv: plan/fitted.py).
NANOTRON_RUNTIME = dataclasses.replace(
    DEFAULT_RUNTIME, activation_recipe="nanotron", launch_s=fitted.NANOTRON_LAUNCH_S, dp_overlap_fraction=0.0,
    collective_host_s=fitted.NANOTRON_COLLECTIVE_HOST_S, slot_stall_s=fitted.NANOTRON_SLOT_STALL_S,
    pp_cross_node_wait_per_tp_peer_s=fitted.NANOTRON_PP_WAIT_PER_TP_PEER_S,
    dp_bw_efficiency=fitted.NANOTRON_DP_BW_EFFICIENCY, elementwise_passes=fitted.NANOTRON_ELEMENTWISE_PASSES,
    tokens_per_sec_error=fitted.NANOTRON_BAND,  # the Playbook's runs (90th pct: the stalled runs)
    name="nanotron", overlaps="nothing of dp (fp32 buffers reduced after the last backward); "
    "tp exposed; a stall per pipeline slot beyond 32 nodes (the Playbook's cluster)")
# torchtitan (PyTorch-native: FSDP2, DTensor TP, torch.distributed.pipelining), compiled as its
# published runs are: fivefold's compiled profile with torchtitan's FSDP-under-PP policy (blocks
# kept gathered over a step's micro-batches). benchmarks/planner_accuracy.py predicts its runs.
TORCHTITAN_RUNTIME = dataclasses.replace(
    FIVEFOLD_COMPILED, fsdp_gather_once_in_pipeline=True, fuses_output_loss=False, name="torchtitan",
    overlaps="FSDP2 gathers and reduce-scatters under compute (blocks kept gathered under PP); "
    "tp and pp exposed")
# Megatron-LM as published by NVIDIA in 2021-22 (Narayanan et al. 2021; Korthikanti et al. 2022)
# and as Megatron-DeepSpeed ran MT-NLG and BLOOM: fused elementwise kernels (bias-GeLU,
# bias-dropout-add, fused softmax and layer norm), Megatron's own host path (one launch per fused
# op), tp collectives between the matmuls (exposed), the gradient all-reduce after the last
# backward (Korthikanti et al. s6.3: "not overlapped"). Its fused kernels' passes: Inductor's value that
# A100's efficiency and the TE rate were fitted with, not moved by a refit of the torch stacks' passes.
MEGATRON_ELEMENTWISE_PASSES = 4.76
MEGATRON_2022_RUNTIME = dataclasses.replace(
    FIVEFOLD_COMPILED, regathers_inputs=True, regather_overlapped=True, pp_scatter_gather=True,
    dp_overlap_fraction=0.0, ep_overlap="none", attention_kernel="unfused", grad_accum="fused",
    selective_recompute="attention_core", fuses_output_loss=False, elementwise_passes=MEGATRON_ELEMENTWISE_PASSES,
    tokens_per_sec_error=(0.034, 0.066),  # the 9 Megatron-LM rows of published_runs_dev.csv (Korthikanti et al.)
    name="megatron-2022", overlaps="nothing: tp, pp and the dp all-reduce exposed (A100-era "
    "Megatron-LM and Megatron-DeepSpeed)")
# Megatron-DeepSpeed with DeepSpeed's pipeline engine (MT-NLG 530B, BLOOM-176B): Megatron's kernels
# and tensor parallelism, but DeepSpeed's pipeline sends each tp rank's whole activation to its
# peer in the next stage (no scatter over tp) and accumulates the micro-batches' 16-bit gradients
# in .grad with autograd (no accumulation fused into the weight-gradient GEMM).
MEGATRON_DEEPSPEED_RUNTIME = dataclasses.replace(
    MEGATRON_2022_RUNTIME, pp_scatter_gather=False, grad_accum="autograd", name="megatron-deepspeed",
    tokens_per_sec_error=(0.18, 0.20),  # its 4 rows of published_runs_dev.csv (MT-NLG, BLOOM), all too fast
    overlaps="nothing: tp, pp and the dp all-reduce exposed (Megatron-DeepSpeed with DeepSpeed's "
    "pipeline engine: whole activations sent by every tp rank, gradients accumulated by autograd)")
# Megatron-core / NeMo (2024-25, what NVIDIA's H100 and B200 runs use): Transformer Engine with tp
# communication overlapped with the GEMMs (userbuffers; NeMo's tp_comm_overlap, most of it hidden),
# the distributed optimizer with --overlap-grad-reduce and --overlap-param-gather, FP8 casts fused
# into the producing kernels. The expert all-to-all runs between the compute (exposed): Megatron-core
# hides it only under --overlap-moe-expert-parallel-comm (off by default; since MCore v0.14), which
# NVIDIA's gpt-oss-120b H100 and B200 BF16 recipes do not set (Megatron-Bridge
# scripts/performance/configs/gpt_oss/gpt_oss_workload_base_configs.py: moe_a2a_overlap only in the
# GB200 BF16 V2 and FP8-MX V2 recipes); DualPipe(V) still hides it by its schedule ('dualpipe').
# Its memory recipe: bf16 main grads (grad_reduce_in_fp32 = False), reduced in bf16; the
# distributed optimizer's fp32 master and moments over dp x cp (the bf16 recipe's ZeRO-1).
# Attention: Transformer Engine's cuDNN fused attention, FlashAttention-3-class on Hopper
# (~600-660 TFLOP/s forward, ~450-500 backward on causal 8K hdim 128: Shah et al. 2024 Figs. 5-7,
# NVIDIA cuDNN 9 release notes), 0.7 of a large GEMM's rate on the work it runs.
MEGATRON_RUNTIME = dataclasses.replace(
    MEGATRON_2022_RUNTIME, dp_overlap_fraction=1.0, param_gather_overlapped=True, grad_buffer_bytes=2.0,
    frees_sent_outputs=True, moe_probs_in_activation=True,
    reduce_bytes=2.0, attention_rate=0.7, matmul_rate=fitted.MEGATRON_MATMUL_RATE,
    float8_linear_speedup=fitted.MEGATRON_FP8_SPEEDUP,
    tokens_per_sec_error=fitted.MEGATRON_BAND,  # out of sample: benchmarks/calibrate_stacks.py
    tp_exposed_fraction=0.25, float8_cast_bytes_per_element=1.0, ep_overlap="dualpipe", attention_kernel="fused",
    name="megatron", overlaps="tp collectives under the GEMMs (TE userbuffers, a quarter left "
    "exposed), dp gradient reduce-scatter under backward and the weight all-gather under the next "
    "forward (distributed optimizer); expert all-to-all and pp exposed (a2a hidden only under DualPipe(V))")
# IBM's fms-fsdp (foundation-model-stack/fms-fsdp, the 2024 Llama 2 runs on 128 A100s): PyTorch
# FSDP, eager, as fivefold's eager profile runs it, except that its bfSixteen mixed-precision
# policy reduces gradients in bf16 (fms_fsdp/policies/mixed_precision.py: reduce_dtype=bfloat16).
FMS_FSDP_RUNTIME = dataclasses.replace(
    FIVEFOLD_EAGER, reduce_bytes=2.0, fuses_output_loss=False, name="fms-fsdp",
    overlaps="FSDP gathers and bf16 gradient reduce-scatters (HSDP: and all-reduces) under compute; "
    "nothing else to overlap (no tp or pp)")
FRAMEWORKS: dict[str, Runtime] = {
    "fivefold": FIVEFOLD_EAGER, "fivefold-compiled": FIVEFOLD_COMPILED, "nanotron": NANOTRON_RUNTIME,
    "torchtitan": TORCHTITAN_RUNTIME, "megatron-2022": MEGATRON_2022_RUNTIME,
    "megatron-deepspeed": MEGATRON_DEEPSPEED_RUNTIME, "megatron": MEGATRON_RUNTIME,
    "nemo": MEGATRON_RUNTIME, "fms-fsdp": FMS_FSDP_RUNTIME,
}


def runtime_for(compile: bool = False, family: str = "fivefold") -> Runtime:
    """The runtime profile of a run: fivefold eager or compiled, or another framework's profile
    by name (FRAMEWORKS: what each overlaps is in its `overlaps`)."""
    if family and family != "fivefold":
        return FRAMEWORKS[family]
    return FIVEFOLD_COMPILED if compile else FIVEFOLD_EAGER
