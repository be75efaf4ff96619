"""Muon's optimizer step (train.optimizer = muon) on one rank, priced: which block matrices the rank
holds and who orthogonalises each, the collectives that bring a matrix whole to its owner and its
result back, and the seconds both take. What is priced is what the trainer does
(parallel/data/muon_step.py for ZeRO-1/2's flat chunks, parallel/muon_dtensor.py for tensor-parallel
and FSDP2 shards, train/muon.py for the loop over tensors):

- whole, no communication: zero 0 or no data parallelism (every rank holds its matrices whole), a
  pipeline stage's own matrices, an MoE layer's weights and latent attention's down-projections
  under tp (whole on every tp rank), experts held by one rank alone (expert-data-parallel group 1);
- ZeRO-1/2 (dp·cp > 1): flat buckets (25 MiB of fp32, in reverse parameter order, Muon's tensors
  apart from AdamW's, routed experts apart on their expert-data-parallel group under ep). Per bucket
  one fp32 all-gather of the chunks and one fp32 reduce-scatter back; each whole matrix on one
  owner (largest first to the least-loaded rank by Newton–Schulz flops, loads kept over the
  buckets); a tensor-parallel shard in a bucket is gathered over tp as below;
- DTensors (tp-split matrices under tp; every tensor under FSDP2 at zero 3): per tensor one fp32
  all-gather over each sharded mesh dimension (`full_tensor`), the owner orthogonalises, and one
  all-reduce of the whole over each mesh dimension (the owner's result, zeros elsewhere) hands every
  rank its shard.

Time. The optimizer takes its tensors in windows (as many buckets as the data-parallel group has
ranks; as many DTensors as the largest mesh has ranks): a window's tensors are all gathered, then
each owner orthogonalises its own, then all are returned. So Muon's time is the gathers and
returns of every tensor plus, per window, the slowest owner's Newton–Schulz in it: spread owners
work at the same time even where a bucket holds one matrix (a large model's). Under FSDP2 with tp
the tp-split tensors and the others are windowed apart (they share windows in the trainer: a
slight over-estimate). The step is exposed:
it runs after the last backward. Newton–Schulz is 5 steps of three bf16 products of the small
side's Gram (A = X Xᵀ, B = bA + cA², X ← aX + BX), each a GEMM at plan/speed/gemm.py's rate.
Muon's elementwise passes (momentum, Nesterov, decay, the update) stay in estimate.py's optimizer
term: one moment instead of AdamW's two, but unfused, about the same bytes per element.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field
from functools import lru_cache

from fivefold.plan import comm
from fivefold.plan.block_matrices import BlockMatrix, block_matrices
from fivefold.plan.speed.gemm import Gemm, gemm_seconds
from fivefold.plan.hardware import Hardware
from fivefold.plan.layout import Layout
from fivefold.plan.memory.peak import as_trained
from fivefold.plan.model_stats import ModelStats
from fivefold.plan.pipeline.schedule import PipelineRank

NS_STEPS = 5  # torch.optim.Muon's DEFAULT_NS_STEPS (train/muon.py runs torch's own iteration)
# The update Muon gathers is the momentum of the fp32 gradient: fp32 in every recipe (bf16 too).
UPDATE_BYTES = 4
# parallel/data/buckets.py BUCKET_BYTES, restated so the planner imports no torch (a test holds
# them equal): a bucket closes once its fp32 elements reach it.
BUCKET_BYTES = 25 * 2**20


def ns_flops(shape: tuple[int, int]) -> float:
    """Newton–Schulz FLOPs of one matrix: per step X Xᵀ (2 s² l), B·A (2 s³), B X (2 s² l)."""
    small, large = sorted(shape)
    return NS_STEPS * (4.0 * small * small * large + 2.0 * small ** 3)


@lru_cache(maxsize=4096)
def ns_seconds(shape: tuple[int, int], hw: Hardware) -> float:
    """One matrix's Newton–Schulz: its three products per step, each a bf16 GEMM (plan/speed/gemm.py:
    compute or memory bound, plus a kernel's fill)."""
    s, l = sorted(shape)
    return sum(gemm_seconds(Gemm(m, n, k, count=NS_STEPS), hw)
               for m, n, k in ((s, s, l), (s, s, s), (s, l, s)))


@dataclass
class MuonStep:
    """Muon's part of one rank's optimizer step."""
    newton_schulz_s: float = 0.0  # the owners' products, in the sequence the collectives impose
    gather_s: float = 0.0  # the collectives that bring matrices whole and hand the results back
    bytes: dict = field(default_factory=lambda: {"dp": 0.0, "tp": 0.0})  # sent by this rank per step
    shares: dict = field(default_factory=dict)  # "dense" / "experts" -> Newton–Schulz flops per rank of its group
    where: list = field(default_factory=list)  # one phrase per path its tensors take

    @property
    def seconds(self) -> float:
        return self.newton_schulz_s + self.gather_s

    def to_json(self) -> dict:
        return {"where": "; ".join(self.where), "newton_schulz_s": self.newton_schulz_s,
                "gather_s": self.gather_s,
                "gflop_by_rank": {k: [round(f / 1e9, 3) for f in v] for k, v in self.shares.items()}}


def muon_step(stats: ModelStats, layout: Layout, order: tuple[str, ...], hw: Hardware, dp_efficiency: float,
              prank: PipelineRank) -> MuonStep:
    """Muon's optimizer step on a rank of pipeline rank `prank` (the options that do not touch it
    dropped, so that a search's layouts share one answer)."""
    key = dataclasses.replace(as_trained(layout), mbs=1, recompute="none", sp=True, cp_method="ring")
    return _muon_step(stats, key, tuple(order), hw, dp_efficiency, prank)


@lru_cache(maxsize=4096)  # shared by every caller: read it, never change it
def _muon_step(stats, layout, order, hw, eff, prank) -> MuonStep:
    group, dense_link, expert_link = comm.data_parallel_links(layout, order, hw.gpus_per_node)
    tp_link = comm.placement(layout, order, ("tp",), hw.gpus_per_node)
    replicas = layout.dp // (layout.dp_shard or layout.dp)
    replica_link = comm.Link(replicas, replicas if group.intra_node else 1)
    tensors = tuple(t for layer in prank.layers for t in block_matrices(stats, layer, layout.ep))
    step = MuonStep()
    # Under ep the routed experts have their own buckets and FSDP2 mesh, on the expert-data-parallel
    # group; without it they are dense weights like the rest.
    streams = ((("dense", False), dense_link, replica_link), (("experts", True), expert_link, comm.Link(1, 1)))
    pooled = ()  # the owners' loads, kept from the dense buckets to the experts' (muon_step.py)
    for (name, expert), link, replica in streams:
        mine = tuple(t for t in tensors if (t.expert and layout.ep > 1) == expert)
        if not mine:
            continue
        if link.size > 1 and layout.zero in (1, 2):
            pooled = _bucketed(step, name, mine, link, tp_link, layout.tp, hw, eff, pooled)
        elif link.size > 1 and layout.zero >= 3:
            _fsdp(step, name, mine, link, tp_link, replica, layout.tp, hw, eff)
        else:
            _unsharded(step, name, mine, tp_link, layout.tp, hw)
    return step


def _tp_dtensor(step: MuonStep, t: BlockMatrix, tp_link: comm.Link, hw: Hardware) -> None:
    """A tensor-parallel DTensor's collectives: gathered whole over tp, all-reduced back (its
    Newton–Schulz is its owner's, priced by window: windowed_seconds)."""
    whole = UPDATE_BYTES * t.numel
    step.gather_s += comm.gather_time(whole, tp_link, hw) + comm.all_reduce_time(whole, tp_link, hw)
    step.bytes["tp"] += 3 * (tp_link.size - 1) / tp_link.size * whole


def windowed_seconds(tensors, ranks: int, hw: Hardware) -> float:
    """Newton–Schulz seconds of DTensors orthogonalised each on one of `ranks` owners, in windows of
    `ranks` consecutive tensors (parameter order): per window the slowest owner's sum. Owners by
    parallel/muon_dtensor.py's rule: largest first to the least-loaded rank, the lowest on a tie."""
    flops = [t.count * ns_flops(t.shape) for t in tensors]
    loads, owner = [0.0] * ranks, {}
    for i in sorted(range(len(tensors)), key=lambda i: (-flops[i], i)):
        owner[i] = loads.index(min(loads))
        loads[owner[i]] += flops[i]
    total = 0.0
    for first in range(0, len(tensors), ranks):
        here = [0.0] * ranks
        for i in range(first, min(first + ranks, len(tensors))):
            here[owner[i]] += tensors[i].count * ns_seconds(tensors[i].shape, hw)
        total += max(here)
    return total


def _unsharded(step, name, tensors, tp_link, tp, hw) -> None:
    """No data-parallel sharding: whole tensors here, tp-split ones as tensor-parallel DTensors."""
    everywhere, owned, split = 0.0, [], []
    for t in tensors:
        if t.tp_split and tp > 1:
            _tp_dtensor(step, t, tp_link, hw)
            owned.append(t.count * ns_flops(t.shape))
            split.append(t)
        else:  # every tp rank holds it whole and orthogonalises it
            step.newton_schulz_s += t.count * ns_seconds(t.shape, hw)
            everywhere += t.count * ns_flops(t.shape)
    step.newton_schulz_s += windowed_seconds(split, tp, hw) if split else 0.0
    step.shares[name] = _owners([everywhere] * tp, owned)
    if tp == 1 or not owned:
        step.where.append(f"{name}: whole on every rank, nothing gathered")
    else:
        step.where.append(f"{name}: tp shards gathered, each tensor orthogonalised on one of its {tp} tp ranks "
                          "and all-reduced back; MoE and latent matrices whole on every tp rank")


def _bucketed(step, name, tensors, link, tp_link, tp, hw, eff, pooled: tuple) -> tuple:
    """ZeRO-1/2: per bucket an fp32 all-gather and reduce-scatter over the data-parallel group,
    whole matrices on their owners, tensor-parallel shards in it gathered over tp one by one."""
    n = link.size
    numels, plain_s, plain_loads, split, pooled = _bucket_plan(tensors, n, tp, hw, pooled)
    for numel in numels:
        step.gather_s += 2 * comm.gather_time(UPDATE_BYTES * numel, link, hw, eff)
        step.bytes["dp"] += 2 * (n - 1) / n * UPDATE_BYTES * numel
    step.newton_schulz_s += plain_s
    slots = [0.0] * (n * tp)  # (data-parallel rank, tp rank)
    for d in range(n):  # a whole matrix's owner d orthogonalises it on each of its tp ranks
        for j in range(tp):
            slots[d * tp + j] = plain_loads[d]
    for t in split:
        _tp_dtensor(step, t, tp_link, hw)
    step.newton_schulz_s += windowed_seconds(split, n * tp, hw) if split else 0.0
    step.shares[name] = _owners(slots, [t.count * ns_flops(t.shape) for t in split])
    step.where.append(f"{name}: {len(numels)} ZeRO buckets, each fp32 all-gathered and reduce-scattered over "
                      f"{n} data-parallel ranks, each matrix orthogonalised on one of them"
                      + (" (tp shards gathered over tp too)" if split else ""))
    return pooled


@lru_cache(maxsize=1024)
def _bucket_plan(tensors: tuple[BlockMatrix, ...], n: int, tp: int, hw: Hardware, pooled: tuple = ()):
    """(each bucket's local elements, the sum over windows of n buckets of the slowest owner's
    Newton–Schulz seconds, flops per data-parallel rank, the tp-split tensors) of
    parallel/data/buckets.py's make_buckets and muon_step.py's owners and windows."""
    buckets, current, size = [], [], 0
    for t in reversed(tensors):  # buckets fill in reverse parameter order, as backward completes them
        current.append(t)
        size += t.numel // (tp if t.tp_split else 1) * 4
        if size >= BUCKET_BYTES:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    # (flops owned so far, rank): the least loaded, lowest rank first. The trainer keeps one load
    # per group index over all its buckets, the experts' after the dense ones: `pooled`.
    heap = [(pooled[r] if r < len(pooled) else 0.0, r) for r in range(n)]
    flops, seconds, split = [0.0] * n, 0.0, []
    here = [0.0] * n  # each rank's seconds in the current window of n buckets (muon_step.py)
    for index, bucket in enumerate(buckets):
        whole = [t for t in bucket if not (t.tp_split and tp > 1)]
        split += [t for t in bucket if t.tp_split and tp > 1]
        for shape in sorted((t.shape for t in whole for _ in range(t.count)), key=lambda s: -ns_flops(s)):
            load, owner = heapq.heappop(heap)
            heapq.heappush(heap, (load + ns_flops(shape), owner))
            flops[owner] += ns_flops(shape)
            here[owner] += ns_seconds(shape, hw)
        if (index + 1) % n == 0 or index == len(buckets) - 1:
            seconds += max(here)
            here = [0.0] * n
    numels = tuple(sum(t.numel // (tp if t.tp_split else 1) for t in b) for b in buckets)
    loads = dict(enumerate(pooled))
    loads.update({r: load for load, r in heap})
    return numels, seconds, tuple(flops), tuple(split), tuple(loads[r] for r in range(len(loads)))


def _fsdp(step, name, tensors, link, tp_link, replica, tp, hw, eff) -> None:
    """FSDP2 at zero 3: each tensor gathered over its sharded mesh dimensions (tp first, then the
    data-parallel shards), orthogonalised on its owner, all-reduced over every mesh dimension (HSDP's
    replicas too)."""
    n = link.size
    meshes = []  # (flops, whether its mesh spans tp)
    for t in tensors:
        whole = UPDATE_BYTES * t.numel
        over_tp = t.tp_split and tp > 1
        if over_tp:
            step.gather_s += comm.gather_time(whole / n, tp_link, hw) + comm.all_reduce_time(whole, tp_link, hw)
            step.bytes["tp"] += (tp - 1) / tp * whole / n + 2 * (tp - 1) / tp * whole
        step.gather_s += (comm.gather_time(whole, link, hw, eff) + comm.all_reduce_time(whole, link, hw, eff)
                          + comm.all_reduce_time(whole, replica, hw, eff))
        step.bytes["dp"] += 3 * (n - 1) / n * whole + 2 * (replica.size - 1) / replica.size * whole
        meshes.append((t.count * ns_flops(t.shape), over_tp))
    over_tp = [t for t in tensors if t.tp_split and tp > 1]  # on the (dp, tp) mesh
    each_tp_rank = [t for t in tensors if not (t.tp_split and tp > 1)]  # on each tp rank's dp mesh
    step.newton_schulz_s += ((windowed_seconds(over_tp, n * tp, hw) if over_tp else 0.0)
                             + (windowed_seconds(each_tp_rank, n, hw) if each_tp_rank else 0.0))
    slots = [0.0] * (n * tp)  # (data-parallel rank, tp rank)
    for work, over_tp in sorted(meshes, key=lambda m: -m[0]):
        if over_tp:
            _assign(slots, work)
        else:  # each tp rank's own copy, on its own data-parallel mesh
            for j in range(tp):
                column = slots[j::tp]
                _assign(column, work)
                slots[j::tp] = column
    step.shares[name] = slots
    step.where.append(f"{name}: FSDP2 shards, each tensor gathered whole and orthogonalised on one of the "
                      f"{n * (tp if any(t.tp_split for t in tensors) else 1)} ranks of its mesh, all-reduced back")


def _owners(loads: list, works: list) -> list:
    """Loads after giving each of `works` an owner, largest first (the trainer's order)."""
    loads = list(loads)
    for work in sorted(works, reverse=True):
        _assign(loads, work)
    return loads


def _assign(loads: list, work: float) -> None:
    """The trainer's owner rule: to the least-loaded rank, the lowest on a tie."""
    loads[loads.index(min(loads))] += work
