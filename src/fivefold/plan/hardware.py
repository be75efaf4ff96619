"""Hardware profiles (what a GPU and its cluster can do) and the runtime profile (what our eager
PyTorch stack costs on top of the hardware).

Numbers are datasheet values where a datasheet exists; the few "achievable" constants are
calibrated once against the published Ultra-Scale Playbook runs (benchmarks/planner_accuracy.py)
and are documented next to their value. No constant is fitted per model or per layout.
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
    # (not a microbenchmark). Calibrated with Runtime.elementwise_passes: the 1-node Playbook runs
    # (39-47% MFU on H100 for 1B-8B models) are predicted within 7% at 0.50.
    matmul_efficiency: float = 0.50
    # Latency of one step of a ring collective (a ring over n ranks takes n-1 steps).
    intra_latency_s: float = 10e-6  # NVLink hop
    # IB hop as seen by NCCL rings spanning nodes. Calibrated: the Playbook's tp=16 (2 nodes) and
    # tp=32 (4 nodes) runs at 1 sequence per micro-batch take 8 and 16 ms per layer for every
    # model size, i.e. latency-bound: 8 collectives x (t-1) steps x ~65 us.
    inter_latency_s: float = 65e-6
    fused_attention: bool = True  # FlashAttention-style kernel: no s^2 score matrix is stored
    # ... also for a value head dim other than q/k's (MLA): CUDA's memory-efficient kernel takes
    # one, the CPU flash kernel does not (SDPA then runs its math path).
    fused_attention_distinct_v: bool = True

    def fuses_attention(self, stats) -> bool:
        """Whether this model's attention runs in a fused kernel on this device."""
        distinct_v = stats.v_head_dim not in (0, stats.head_dim)
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
    """What the training software costs beyond the hardware (eager PyTorch, NCCL, allocator).

    Calibrated on the Playbook's nanotron runs (eager PyTorch, like fivefold without compile);
    benchmarks/planner_accuracy.py reports how well these few constants explain 1,620 runs.
    """
    # cuBLAS/NCCL workspaces and allocator fragmentation: memory no tensor of the model owns.
    fixed_bytes: float = 0.5 * GB
    # Which implementation's activations to count (plan/memory.py): 'fivefold' (ours, measured on
    # our runs) or 'nanotron' (the Playbook's runs, for benchmarks/planner_accuracy.py).
    activation_recipe: str = "fivefold"
    # 'nanotron' recipe: bytes per logit element held at the loss: bf16 logits (2), the fp32 copy
    # the softmax works on (4), and its fp32 gradient (4).
    logits_bytes_per_element: float = 10.0
    # Host time to launch one transformer layer's kernels (forward + backward) for one micro-batch.
    # The GPU cannot run faster than the host feeds it: a stage's micro-batch takes at least
    # layers x this. With tensor parallelism every layer adds collectives and many more small
    # kernels, which is why the Playbook's tp>1 runs at 1 sequence per micro-batch all take
    # ~4.5 ms per layer whatever t is.
    host_s_per_layer: float = 1.0e-3
    host_s_per_layer_tp: float = 4.4e-3
    # Observed in every Playbook run whose pipeline crosses nodes with tp > 1: the per-layer floor
    # grows with t (about 10, 15 and 24 ms at t = 2, 4, 8, whatever the model size), as if the
    # host serviced each tensor-parallel peer's share of the cross-node pipeline traffic in turn.
    host_s_per_layer_per_tp_peer_pp_inter: float = 2.1e-3
    # Elementwise kernels read and write each saved activation this many times over forward and
    # backward (memory-bound work that the matmul efficiency does not cover).
    elementwise_passes: float = 4.0
    # Share of tensor-parallel communication the GPU does not hide behind matmuls.
    tp_exposed_fraction: float = 1.0
    # Share of the link bandwidth the data-parallel gradient reduction reaches. Calibrated: the
    # Playbook's multi-node data-parallel runs lose 0.1-0.6 s per step to it, as if their fp32
    # gradient buffers moved at ~25 GB/s per GPU of the ring and node (60% of the NIC rate).
    dp_bw_efficiency: float = 0.6
    # Share of the last micro-batch's backward that gradient reduction hides behind. The Playbook's
    # runs show no hiding (nanotron reduces its fp32 accumulation buffers after the last backward).
    dp_overlap_fraction: float = 0.0
    # Fixed cost of every optimizer step beyond the optimizer's memory traffic: gradient norm and
    # clipping, zeroing, loss reduction, logging (many small eager kernels per parameter tensor).
    step_overhead_s: float = 0.08


DEFAULT_RUNTIME = Runtime()
# The Playbook's runs were made with nanotron: its activations, the same constants otherwise.
NANOTRON_RUNTIME = dataclasses.replace(DEFAULT_RUNTIME, activation_recipe="nanotron")


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
