"""Hardware profiles (what a GPU and its cluster can do) and the runtime profile (what our eager
PyTorch stack costs on top of the hardware).

Numbers are datasheet values where a datasheet exists; the few "achievable" constants are fitted
on two published data sets, the Ultra-Scale Playbook's nanotron runs and torchtitan's PyTorch-native
runs (`PYTHONPATH=src .venv/bin/python benchmarks/calibrate_time.py`; errors from
benchmarks/planner_accuracy.py in benchmarks/RESULTS.md, 2026-12-01) and are documented next to
their value. No constant is fitted per model, per layout or per row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 (fp32 for the CPU profile), FLOP/s per device
    memory_bytes: float  # device memory the allocator can hand out
    hbm_bw: float  # device memory bandwidth, bytes/s (optimizer step is bandwidth bound)
    intra_bw: float  # achievable collective bus bandwidth inside a node (NVLink), bytes/s per GPU
    nic_bw: float  # achievable network bandwidth per GPU (one NIC per GPU), bytes/s
    gpus_per_node: int = 8
    # Share of peak that a transformer's matmuls + fused attention reach in a real training step
    # (not a microbenchmark). Fitted with Runtime.elementwise_passes on both data sets
    # (benchmarks/calibrate_time.py): 0.55.
    matmul_efficiency: float = 0.55
    # Latency of one step of a ring collective (a ring over n ranks takes n-1 steps).
    intra_latency_s: float = 10e-6  # NVLink hop
    # IB hop as seen by NCCL rings spanning nodes. Fitted (calibrate_time.py): the Playbook's tp=16
    # (2 nodes) and tp=32 (4 nodes) runs at 1 sequence per micro-batch take 8 and 16 ms per layer
    # for every model size, i.e. latency-bound: 8 collectives x (t-1) steps x ~50 us.
    inter_latency_s: float = 57e-6
    # A collective spanning k nodes reaches nic_bw / (1 + (k - 1) / fabric_nodes) per GPU: the
    # more nodes a ring or tree crosses, the more of its traffic goes through the spine switches
    # (oversubscribed, shared with other flows). Calibrated on both data sets (calibrate_time.py).
    fabric_nodes: float = 36.0
    # Nodes under one set of leaf switches (a DGX SuperPOD "scalable unit" is 32 nodes): a job
    # larger than that has every transfer's path cross the spine.
    scalable_unit_nodes: int = 32
    fused_attention: bool = True  # FlashAttention-style kernel: no s^2 score matrix is stored
    # ... also for a value head dim other than q/k's (MLA): CUDA's memory-efficient kernel takes
    # one, the CPU flash kernel does not (SDPA then runs its math path).
    fused_attention_distinct_v: bool = True

    def fuses_attention(self, stats) -> bool:
        """Whether this model's attention runs in a fused kernel on this device."""
        distinct_v = stats.v_head_dim not in (0, stats.head_dim)
        if stats.attention_sinks:  # fivefold's sink attention is plain PyTorch (models/masked_attention.py)
            return False
        return self.fused_attention and (self.fused_attention_distinct_v or not distinct_v)


# Dense tensor-core peaks per device, FLOP/s: (bf16, fp32 as TF32), datasheet values. The one
# table: the profiles below and the trainer's MFU (train/metrics.py, by the name CUDA reports) read it.
PEAK_FLOPS: dict[str, tuple[float, float]] = {
    "a100": (312 * TB, 156 * TB),
    "h100": (989 * TB, 494 * TB),
    "h200": (989 * TB, 494 * TB),
    "h800": (989 * TB, 494 * TB),
    "b200": (2250 * TB, 1100 * TB),
    "l40s": (362 * TB, 183 * TB),
}


def device_peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak FLOP/s of a GPU by the name CUDA reports ("NVIDIA H100 80GB HBM3") for a run's dtype
    (bf16 | fp32), or None for a device the table does not know."""
    name = device_name.lower()
    for key, (bf16, tf32) in PEAK_FLOPS.items():
        if key in name:
            return bf16 if dtype == "bf16" else tf32
    return None


# Datasheet values (NVIDIA SXM parts, DGX-style nodes of 8 GPUs with one 400 Gb/s NIC per GPU).
# Bus bandwidths are what NCCL reaches, about 80% of the link rate: NVLink 4 moves 450 GB/s each
# way per GPU, so ~360 GB/s; a 400 Gb/s NIC moves 50 GB/s, so ~40 GB/s.
PROFILES: dict[str, Hardware] = {
    "a100": Hardware("a100", peak_flops=PEAK_FLOPS["a100"][0], memory_bytes=80 * GB, hbm_bw=2.0 * TB,
                     intra_bw=240 * GB, nic_bw=20 * GB),  # NVLink 3 (300 GB/s/dir), 200 Gb/s HDR
    "h100": Hardware("h100", peak_flops=PEAK_FLOPS["h100"][0], memory_bytes=80 * GB, hbm_bw=3.35 * TB,
                     intra_bw=360 * GB, nic_bw=40 * GB),
    "h200": Hardware("h200", peak_flops=PEAK_FLOPS["h200"][0], memory_bytes=141 * GB, hbm_bw=4.8 * TB,
                     intra_bw=360 * GB, nic_bw=40 * GB),
    "b200": Hardware("b200", peak_flops=PEAK_FLOPS["b200"][0], memory_bytes=180 * GB, hbm_bw=8.0 * TB,
                     intra_bw=720 * GB, nic_bw=40 * GB),  # NVLink 5 (900 GB/s/dir), 400 Gb/s NIC
    # One CPU process of a laptop run under gloo: for comparing with local runs, not for speed claims.
    "cpu": Hardware("cpu", peak_flops=0.1 * TB, memory_bytes=16 * GB, hbm_bw=20 * GB,
                    intra_bw=4 * GB, nic_bw=1 * GB, gpus_per_node=64, matmul_efficiency=0.5,
                    intra_latency_s=100e-6, inter_latency_s=200e-6,  # CPU SDPA is a flash kernel too,
                    fused_attention_distinct_v=False),  # for equal q/k and v head dims only
}


@dataclass(frozen=True)
class Runtime:
    """What the training software costs beyond the hardware (framework, NCCL, allocator).

    Three profiles below: fivefold eager, fivefold compiled (both calibrated on torchtitan's
    PyTorch-native runs, the stack fivefold is built from) and nanotron (the Playbook's runs).
    Every time constant is a physical quantity (a host time per kernel, a share of a bandwidth,
    a number of passes over memory); none is fitted per model, per layout or per row. The fitted
    values come from `benchmarks/calibrate_time.py` (command and errors in benchmarks/RESULTS.md).
    """
    # cuBLAS/NCCL workspaces and allocator fragmentation: memory no tensor of the model owns.
    fixed_bytes: float = 0.5 * GB
    # Which implementation's activations to count (plan/activations.py): 'fivefold' (ours, measured on
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
    elementwise_passes: float = 4.0
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
    # FP8 linear layers (train.fp8, torchao's float8 recipes): how much faster the matmuls of the
    # dense projections run, after the casts, than in bf16 (the FP8 peak is 2x). Applied only to a
    # workload that trains in FP8 (plan/estimate.py); fitted on torchtitan's float8 rows, which use
    # the same torchao kernels (benchmarks/calibrate_time.py).
    float8_linear_speedup: float = 1.16
    # torchtitan only (its PP + FSDP keeps blocks gathered across a step's micro-batches);
    # fivefold gathers each block for every micro-batch's forward and backward (parallel/data/fsdp.py).
    fsdp_gather_once_in_pipeline: bool = False
    # The calibration's tokens/s error for this profile (median, 90th percentile of |pred/meas-1|),
    # printed as the uncertainty band beside every prediction.
    tokens_per_sec_error: tuple[float, float] = (0.092, 0.27)  # torchtitan's 18 runs


# fivefold eager: calibrated on torchtitan's bf16/FP8 runs (8-512 H100s), the PyTorch-native
# stack fivefold is built from (benchmarks/calibrate_time.py --profile eager).
FIVEFOLD_EAGER = Runtime()
# fivefold with train.compile: Inductor fuses the elementwise chains (fewer passes over memory,
# fewer and longer kernels).
FIVEFOLD_COMPILED = dataclasses.replace(FIVEFOLD_EAGER, elementwise_passes=3.1, kernels_per_layer=40,
                                        regathers_inputs=False)
DEFAULT_RUNTIME = FIVEFOLD_EAGER
# The Playbook's runs were made with nanotron: its activations, async TP linear (part of the tp
# traffic hidden), fp32 gradient buffers reduced after the last backward, and its own host costs
# (calibrated on playbook_runs_dev.csv, benchmarks/calibrate_time.py --profile nanotron).
NANOTRON_RUNTIME = dataclasses.replace(
    DEFAULT_RUNTIME, activation_recipe="nanotron", launch_s=7.4e-6, collective_host_s=425e-6,
    pp_cross_node_wait_per_tp_peer_s=0.286e-3, slot_stall_s=0.88,
    dp_bw_efficiency=0.92, elementwise_passes=6.4, dp_overlap_fraction=0.0,
    tokens_per_sec_error=(0.116, 2.27))  # the Playbook's 1,620 runs (90th pct: the stalled runs)


def runtime_for(compile: bool = False, family: str = "fivefold") -> Runtime:
    """The runtime profile of a run: fivefold eager or compiled, or 'nanotron'."""
    if family == "nanotron":
        return NANOTRON_RUNTIME
    return FIVEFOLD_COMPILED if compile else FIVEFOLD_EAGER


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
    }
    return hardware_for(cluster.gpu, cluster.gpus_per_node, **extra)
