"""Hardware profiles (what a GPU and its cluster can do) and the runtime profile (what our eager
PyTorch stack costs on top of the hardware).

Numbers are datasheet values where a datasheet exists; the few "achievable" constants are fitted
on published runs (the Playbook's, torchtitan's, NVIDIA's NeMo runs) and live in plan/fitted.py,
written by benchmarks/calibrate_time.py and calibrate_stacks.py with their fit sets and errors
out of sample; what each is physically is said here, by its field. None is fitted per model,
layout or row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from fivefold.plan.cached_hash import cached_hash, state_without_hash
from fivefold.plan import fitted
from fivefold.plan.peak_flops import PEAK_FLOPS

GB = 1e9
TB = 1e12
MiB = 2 ** 20
GiB = 2 ** 30


@dataclass(frozen=True)
class Hardware:
    __hash__ = cached_hash  # computed once: the search's memo tables are keyed by it
    __getstate__ = state_without_hash
    name: str
    peak_flops: float  # dense bf16 (fp32 for the CPU profile), FLOP/s per device
    # Device memory in bytes as the driver reports it (nvidia-smi's "Total" in MiB): a GPU sold as
    # "80 GB" holds 80 GiB of HBM less what the driver reserves (H100: 81,559 MiB = 79.6 GiB =
    # 85.5 GB). What the process itself costs (CUDA context, NCCL buffers, the framework's
    # workspaces) is counted in each rank's "other" memory, not taken off here.
    memory_bytes: float
    hbm_bw: float  # device memory bandwidth, bytes/s (optimizer step is bandwidth bound)
    intra_bw: float  # achievable collective bus bandwidth inside a node (NVLink), bytes/s per GPU
    nic_bw: float  # achievable network bandwidth per GPU (one NIC per GPU), bytes/s
    gpus_per_node: int = 8
    # Share of the dense peak that a large GEMM (and the fused attention kernel) sustains inside a
    # training step: below a microbenchmark's, since clocks fall under a whole step's power draw.
    # Smaller GEMMs reach less (plan/speed/gemm.py: the fill time below and the memory roofline).
    # H100's is fitted (with Runtime.elementwise_passes); other GPUs' in PROFILES, with sources.
    matmul_efficiency: float = fitted.H100_MATMUL_EFFICIENCY
    # Ramp-up and tail of one GEMM kernel (first wave filling the SMs, K-loop prologue, epilogue,
    # last partial wave): about one wave of 128x256 tiles. With it a 1024^3 bf16 GEMM reaches a
    # quarter of peak and a 4096^3 one two thirds, as published cuBLAS sweeps show on H100 and A100
    # (NVIDIA's "Matrix Multiplication Background" guide; plan/speed/gemm.py).
    gemm_fill_s: float = 6e-6
    # Whether the tensor cores run FP8 (Hopper, Blackwell); A100 has none: train.fp8 gains nothing.
    has_fp8: bool = True
    intra_latency_s: float = 10e-6  # one ring step of a collective (n ranks: n-1 steps) over NVLink
    # IB hop as seen by NCCL rings spanning nodes. Fitted: the Playbook's tp=16
    # (2 nodes) and tp=32 (4 nodes) runs at 1 sequence per micro-batch take 8 and 16 ms per layer
    # for every model size, i.e. latency-bound: 8 collectives x (t-1) steps x ~50 us.
    inter_latency_s: float = fitted.INTER_NODE_LATENCY_S
    # The network between nodes (the [cluster] key `fabric`):
    #   'full_bisection' (default): a rail-optimised fat tree, as DGX SuperPODs and the H100/B200
    #     clusters of the published runs are built: every GPU's NIC reaches any other node at its
    #     full rate, so a collective's bandwidth per GPU does not fall with the nodes it spans;
    #   'tapered': an oversubscribed fabric, where a collective spanning k nodes reaches
    #     nic_bw / (1 + (k - 1) / fabric_nodes) per GPU (more of its traffic crosses the spine,
    #     shared with other jobs). fabric_nodes is fitted on the Playbook's cluster, the one data
    #     set showing such a falloff.
    fabric: str = "full_bisection"
    fabric_nodes: float = fitted.TAPERED_FABRIC_NODES
    # Nodes under one set of leaf switches (a DGX SuperPOD "scalable unit" is 32 nodes): a job
    # larger than that has every transfer's path cross the spine.
    scalable_unit_nodes: int = 32
    fused_attention: bool = True  # FlashAttention-style kernel: no s^2 score matrix is stored
    # Fixed memory every process on the device pays before any tensor (plan/memory/framework.py):
    # the CUDA context with its loaded kernels (CUDA 12 lazy loading: ~0.5 GiB measured by
    # PyTorch on A100/H100, "CUDA semantics: memory management"); and the buffers of each NCCL
    # communicator the rank joins: NCCL_BUFFSIZE (4 MiB) per channel for each of the send and
    # receive side of its ring/tree peers, up to 32 channels on NVLink/IB GPUs (NCCL's
    # environment-variable docs), ~0.25 GiB per communicator. 0 on the CPU (gloo).
    # Board power at full load (the datasheets' TDP): goodput's kWh (plan/goodput.py) by default.
    board_watts: float = 700.0
    context_bytes: float = 0.5 * GiB
    comm_buffer_bytes: float = 0.25 * GiB
    # ... also for a value head dim other than q/k's (MLA): CUDA's memory-efficient kernel takes one,
    fused_attention_distinct_v: bool = True  # the CPU flash kernel does not (SDPA runs its math path)

    def fuses_attention(self, stats) -> bool:
        """Whether this model's attention runs in a fused kernel on this device."""
        distinct_v = stats.v_head_dim not in (0, stats.head_dim)
        # Windows and sinks run blockwise through the same kernels (models/attention/masked.py),
        # keeping q, k, v, the output and a log-sum-exp: fused, as far as memory goes.
        return self.fused_attention and (self.fused_attention_distinct_v or not distinct_v)


# Datasheet values (NVIDIA SXM parts, DGX/HGX-style nodes of 8 GPUs with one 400 Gb/s NIC per GPU;
# dense peaks from plan/peak_flops.py, the one table the trainer's MFU reads too).
# Bus bandwidths are what NCCL reaches, about 80% of the link rate: NVLink 4 moves 450 GB/s each
# way per GPU, so ~360 GB/s; a 400 Gb/s NIC moves 50 GB/s, so ~40 GB/s.
# matmul_efficiency by GPU: H100's is fitted (see Hardware). H200/H800 = H100 (the same die and
# clocks) and B200 x0.95, by the ratio of what large bf16 GEMMs sustain in published cuBLAS sweeps
# relative to peak (H100 SXM ~0.7-0.75 of 989 TFLOP/s at 700 W, power-bound clocks; B200 ~0.7 of
# 2,250 at 1,000 W). A100 (~0.85-0.9 of 312 at 400 W in the same sweeps, x1.13-1.29 H100's share):
# 0.70, fitted on the even rows of the A100 published runs (published_runs_dev.csv followed by
# Narayanan et al. 2021 Table 1, each with its framework's profile; benchmarks/RESULTS.md), the
# odd rows held out; within the sweeps' ratio, at its top: an A100 at 400 W keeps its clocks
# through a step where an H100 at 700 W does not.
H100_MATMUL_EFFICIENCY = fitted.H100_MATMUL_EFFICIENCY
A100_MATMUL_EFFICIENCY = 0.70
PROFILES: dict[str, Hardware] = {
    "a100": Hardware("a100", peak_flops=PEAK_FLOPS["a100"][0], memory_bytes=81920 * MiB, hbm_bw=2.0 * TB,
                     intra_bw=240 * GB, nic_bw=20 * GB,  # NVLink 3 (300 GB/s/dir), 200 Gb/s HDR
                     matmul_efficiency=A100_MATMUL_EFFICIENCY, gemm_fill_s=8e-6, has_fp8=False,
                     board_watts=400.0),
    "h100": Hardware("h100", peak_flops=PEAK_FLOPS["h100"][0], memory_bytes=81559 * MiB, hbm_bw=3.35 * TB,
                     intra_bw=360 * GB, nic_bw=40 * GB, matmul_efficiency=H100_MATMUL_EFFICIENCY),
    "h200": Hardware("h200", peak_flops=PEAK_FLOPS["h200"][0], memory_bytes=143771 * MiB, hbm_bw=4.8 * TB,
                     intra_bw=360 * GB, nic_bw=40 * GB, matmul_efficiency=H100_MATMUL_EFFICIENCY),
    # H800: the H100 die with NVLink cut to 400 GB/s both ways (200 GB/s each way, ~160 GB/s bus);
    # DeepSeek's cluster: 8 x 400 Gb/s InfiniBand NICs per node (DeepSeek-V3 report, s3.1).
    "h800": Hardware("h800", peak_flops=PEAK_FLOPS["h800"][0], memory_bytes=81559 * MiB, hbm_bw=3.35 * TB,
                     intra_bw=160 * GB, nic_bw=40 * GB, matmul_efficiency=H100_MATMUL_EFFICIENCY),
    "b200": Hardware("b200", peak_flops=PEAK_FLOPS["b200"][0], memory_bytes=183359 * MiB, hbm_bw=8.0 * TB,
                     intra_bw=720 * GB, nic_bw=40 * GB,  # NVLink 5 (900 GB/s/dir), 400 Gb/s NIC
                     matmul_efficiency=0.95 * H100_MATMUL_EFFICIENCY, gemm_fill_s=4e-6,
                     board_watts=1000.0),
    # One CPU process of a laptop run under gloo: for comparing with local runs, not for speed claims.
    "cpu": Hardware("cpu", peak_flops=0.1 * TB, memory_bytes=16 * GB, hbm_bw=20 * GB,
                    intra_bw=4 * GB, nic_bw=1 * GB, gpus_per_node=64, matmul_efficiency=0.5,
                    gemm_fill_s=0.0, has_fp8=False, context_bytes=0.0, comm_buffer_bytes=0.0, board_watts=65.0,
                    intra_latency_s=100e-6, inter_latency_s=200e-6,  # CPU SDPA is a flash kernel too,
                    fused_attention_distinct_v=False),  # for equal q/k and v head dims only
}


@dataclass(frozen=True)
class Runtime:
    """What the training software costs beyond the hardware (framework, NCCL, allocator).

    Three profiles below: fivefold eager, fivefold compiled (both calibrated on torchtitan's
    PyTorch-native runs, the stack fivefold is built from) and nanotron (the Playbook's runs).
    Every time constant is a physical quantity (a host time per kernel, a share of a bandwidth,
    a number of passes over memory); none is fitted per model, per layout or per row (plan/fitted.py).
    """
    __hash__ = cached_hash  # computed once: the search's memo tables are keyed by it
    __getstate__ = state_without_hash
    # cuBLAS/NCCL workspaces and allocator fragmentation: memory no tensor of the model owns.
    fixed_bytes: float = 0.5 * GB
    # Which implementation's activations to count (plan/memory/activations.py): 'fivefold' (ours, measured on
    # our runs) or 'nanotron' (the Playbook's runs, for benchmarks/planner_accuracy.py).
    activation_recipe: str = "fivefold"
    # 'nanotron' recipe: bytes per logit element held at the loss: bf16 logits (2), the fp32 copy
    # the softmax works on (4), and its fp32 gradient (4).
    logits_bytes_per_element: float = 10.0
    # 'fivefold' recipe, sp without recomputation: the matmuls reading the gathered sequence keep
    # its shard and gather it again in backward (parallel/tensor/sharded_inputs.py). Compiled
    # blocks do not: they keep what the partitioner keeps, the gathered input.
    regathers_inputs: bool = True
    # Kernel launches. The host issues one layer's forward + backward as `kernels_per_layer`
    # kernels (a count of the ops of an eager Llama block: norms, projections, RoPE, attention,
    # SwiGLU, residuals, casts, and their backward), each costing `launch_s` of host time
    # (framework dispatch + cudaLaunch). The host runs ahead of the GPU, so launches are hidden
    # while kernels are longer than that and show only when a layer's GPU work is shorter than
    # its launches: exposed = max(0, kernels x launch - GPU time), per layer.
    launch_s: float = 12e-6
    kernels_per_layer: int = 110
    # Host time of one collective call (enqueue, handle bookkeeping, the stream wait before the
    # consumer): tensor parallelism issues 8 per layer.
    collective_host_s: float = 60e-6
    # nanotron only: with tp > 1 and the pipeline across nodes, each tensor-parallel collective
    # waits behind the pending cross-node pipeline transfers of its tp peers (one device queue per
    # GPU, CUDA_DEVICE_MAX_CONNECTIONS=1), about this long per peer. 0 in fivefold's profiles.
    pp_cross_node_wait_per_tp_peer_s: float = 0.0
    # nanotron only: a stall of every pipeline slot (every micro-batch step) once the job spans
    # more than one scalable unit of the cluster (Hardware.scalable_unit_nodes). The Playbook's
    # 64-node runs lose 0.7-1 s per slot whatever the model, tp or micro-batch size; no bandwidth
    # or latency of the fabric explains it (see RESULTS.md, 2026-12-01). 0 in fivefold's profiles:
    # torchtitan's 64-node runs show none.
    slot_stall_s: float = 0.0
    # Elementwise kernels read and write each saved activation this many times over forward and
    # backward (memory-bound work that the matmul efficiency does not cover); compile fuses them.
    elementwise_passes: float = fitted.EAGER_ELEMENTWISE_PASSES
    # Share of tensor-parallel communication the GPU does not hide behind matmuls (fivefold's
    # DTensor TP runs its collectives between the matmuls: nothing hidden).
    tp_exposed_fraction: float = 1.0
    # Share of the link bandwidth the data-parallel gradient reduction reaches.
    dp_bw_efficiency: float = 0.6
    # Share of the window that gradient reduction / FSDP gathers hide behind (plan/estimate.py:
    # the last micro-batch's backward for zero 0/1, every backward for zero 2, all compute for
    # zero 3). fivefold launches its buckets from gradient hooks and FSDP2 prefetches; nanotron
    # reduces its fp32 accumulation buffers after the last backward (0).
    dp_overlap_fraction: float = 1.0
    # Fixed cost of every optimizer step beyond the optimizer's memory traffic: gradient norm and
    # clipping, zeroing, loss reduction, logging (many small kernels per parameter tensor).
    step_overhead_s: float = 0.08
    # FP8 linear layers (train.fp8): the rate a large FP8 GEMM reaches over a bf16 one (the FP8
    # peak is 2x; plan/speed/gemm.py), before the casts below. Applied only to a workload that trains in
    # FP8, on a GPU with FP8 tensor cores. Fitted on torchtitan's float8 rows (torchao's kernels).
    float8_linear_speedup: float = fitted.FLOAT8_LINEAR_SPEEDUP
    # Memory traffic per operand element to scale and cast it to FP8 before each GEMM pass (amax
    # read, cast read and write): torchao's separate kernels read bf16 twice and write FP8 once
    # (2 + 2 + 1); Transformer Engine fuses the cast into the producing kernel (about 1).
    float8_cast_bytes_per_element: float = 5.0
    # ZeRO-1/2's all-gather of the updated weights after the optimizer step: exposed (fivefold,
    # nanotron) or hidden under the next step's first forward (Megatron's --overlap-param-gather).
    param_gather_overlapped: bool = False
    # Expert all-to-all under compute: 'dualpipe' (only the DualPipe(V) schedule, which runs one
    # micro-batch's forward beside another's backward, hides it), 'always' (a framework that splits
    # each micro-batch to overlap dispatch/combine with the other half's compute, e.g.
    # Megatron-core's --overlap-moe-expert-parallel-comm / DeepEP), or 'none'.
    ep_overlap: str = "dualpipe"
    # Megatron's sequence parallelism gathers a linear layer's input again in backward too, but
    # under the input-gradient GEMM (Korthikanti et al. 2022 s4.2.2); fivefold's re-gather is exposed.
    regather_overlapped: bool = False
    # Bytes per element of the data-parallel gradient reduction when the framework reduces in
    # another dtype than the precision recipe says (0: the recipe's; IBM's fms-fsdp reduces in bf16: 2).
    reduce_bytes: float = 0.0
    # The kernel stack's large-GEMM rate over the one Hardware.matmul_efficiency was fitted with
    # (the torch stacks: fivefold, nanotron, torchtitan): Megatron-core's Transformer Engine
    # GEMMs are fitted on NVIDIA's published runs (plan/fitted.py).
    matmul_rate: float = 1.0
    # What recompute = 'selective' recomputes: 'blocks' (fivefold: norms, activations and, where
    # smaller, each residual branch apart: parallel/recompute.py, plan/memory/branch_split.py) or
    # 'attention_core' (Megatron-LM / Megatron-core: only the core attention, Korthikanti et al.
    # 2022 s4.2; with a fused attention kernel no s x s scores are kept, so it keeps what 'none'
    # keeps: plan/memory/framework.py).
    selective_recompute: str = "blocks"
    # Gradient buffer bytes per weight when the framework keeps its gradients in another dtype than
    # the precision recipe (0: the recipe's). Megatron-core's performance recipes (NeMo 2,
    # Megatron-Bridge) set grad_reduce_in_fp32 = False: the main-grad buffer, which the weight-
    # gradient GEMMs accumulate into and the distributed optimizer reduce-scatters, is bf16 (2).
    grad_buffer_bytes: float = 0.0
    # Bytes per element of the optimizer state (each Adam moment; a master copy of the weights too,
    # unless in the weights' own dtype, when NeMo keeps none) when the run keeps it in another dtype
    # than fp32 (0: fp32, the recipe's). A run's setting, not a framework's: NeMo's Apex
    # DistributedFusedAdam with optim.dtype = bf16 keeps 2 (NVIDIA's Nemotron-4 340B benchmark),
    # its GPT-3 175B config the default fp32. `fivefold plan
    # --optimizer-state-dtype bf16` sets it (plan/memory/framework.py).
    optimizer_state_bytes: float = 0.0
    # Megatron's pipeline frees each stage output's data once sent (deallocate_output_tensor: the
    # next stage holds the copy; only the graph is kept). fivefold keeps it until its backward.
    frees_sent_outputs: bool = False
    # Megatron-core's grouped experts apply the router's weights inside the activation (weighted
    # SwiGLU): a routed copy keeps its input, fc1's output and the weighted activation (h + 3f),
    # not fivefold's dispatched, combined and weighted copies (3h + 3f; plan/memory/activations.py).
    moe_probs_in_activation: bool = False
    # fivefold's output layer computes its loss chunk by chunk and keeps no logits (models/linear_
    # cross_entropy.py); the other stacks make and keep the micro-batch's logits.
    fuses_output_loss: bool = False
    # The fused attention kernel's rate over a large GEMM's, on the FLOPs it runs (a causal mask
    # skips half the square; the FLOP count stays the full square, PaLM's 12 L h s). 0.5: a
    # FlashAttention-2-class kernel (PyTorch SDPA's flash backend) on Hopper, ~350 TFLOP/s forward
    # and ~300 backward against ~750 for cuBLAS (Shah et al. 2024, FlashAttention-3, Figs. 5-7);
    # the value the fitted constants were fitted with (the full square at the GEMM rate).
    attention_rate: float = 0.5
    # The attention core's kernels (plan/speed/attention.py): 'fused' (FlashAttention and its kin)
    # or 'unfused' (Megatron-LM 2021-22: batched score GEMMs, the s x s scores through memory for
    # softmax and dropout, the core's forward recomputed in backward under selective recomputation).
    attention_kernel: str = "fused"
    # Pipeline sends split over the tp ranks even without sequence parallelism, re-gathered over
    # NVLink on arrival (Megatron's scatter/gather optimisation, Narayanan et al. 2021 s4.1).
    pp_scatter_gather: bool = False
    # The framework this profile stands for and what it overlaps (printed with each prediction).
    name: str = "fivefold-eager"
    overlaps: str = ("dp gradient buckets under the last backward (zero 0/1), every backward "
                     "(zero 2), FSDP prefetch (zero 3); ring attention under its blocks; expert "
                     "all-to-all only under dualpipev; tp and pp exposed")
    # How each micro-batch's weight gradients join the step's accumulated ones (plan/speed/grad_accum.py):
    # 'hooks' (fivefold, nanotron: a gradient hook adds the 16-bit gradient into the fp32 buffer, an
    # elementwise pass over the rank's trained weights; fp32 weights: autograd adds in place),
    # 'fused' (Megatron's gradient-accumulation fusion: the weight-gradient GEMM accumulates into
    # the fp32 buffer, no pass of its own) or 'autograd' (DeepSpeed's pipeline engine: autograd
    # adds each 16-bit gradient into .grad in place).
    grad_accum: str = "hooks"
    # torchtitan only (its PP + FSDP keeps blocks gathered across a step's micro-batches);
    # fivefold gathers each block for every micro-batch's forward and backward (parallel/data/fsdp.py).
    fsdp_gather_once_in_pipeline: bool = False

    # The calibration's tokens/s error for this profile (median, 90th percentile of |pred/meas-1|),
    # printed as the uncertainty band beside every prediction.
    tokens_per_sec_error: tuple[float, float] = fitted.FIVEFOLD_BAND  # torchtitan's rows, leave-one-model-out

    def float8_casts(self, fp8: bool) -> float:
        """Cast traffic per operand element of an FP8 GEMM pass (0 for a bf16 one)."""
        return self.float8_cast_bytes_per_element if fp8 else 0.0


@lru_cache(maxsize=64)
def on_stack(hw: Hardware, matmul_rate: float) -> Hardware:
    """The device as a kernel stack drives it: its matmul efficiency times the stack's rate."""
    if matmul_rate == 1.0:
        return hw
    return dataclasses.replace(hw, matmul_efficiency=hw.matmul_efficiency * matmul_rate)


def hardware_for(name: str, gpus_per_node: int | None = None, **overrides) -> Hardware:
    """A profile by name ('h100', ...), with the node size and any field overridden."""
    key = name.strip().lower()
    if key not in PROFILES:
        raise KeyError(key)
    hw = PROFILES[key]
    changes = {k: v for k, v in overrides.items() if v}
    if gpus_per_node:
        changes["gpus_per_node"] = gpus_per_node
    return dataclasses.replace(hw, **changes) if changes else hw


def hardware_from_cluster(cluster) -> Hardware:
    """The [cluster] section -> a profile. Optional keys (peak_tflops, memory_gb, intra_gbps,
    inter_gbps) override the datasheet when the config defines them."""
    extra = {
        "peak_flops": getattr(cluster, "peak_tflops", 0) * TB,
        "memory_bytes": getattr(cluster, "memory_gb", 0) * GB,
        "intra_bw": getattr(cluster, "intra_gbps", 0) * GB,
        "nic_bw": getattr(cluster, "inter_gbps", 0) * GB,
        "fabric": getattr(cluster, "fabric", ""),  # config validation checked it against FABRICS
    }
    return hardware_for(cluster.gpu, cluster.gpus_per_node, **extra)
