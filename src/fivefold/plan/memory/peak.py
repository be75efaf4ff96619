"""Bytes one rank holds at its peak: model state under each ZeRO stage / HSDP, activations under
tp/sp/cp/recomputation and the pipeline schedule, logits, temporary buffers, runtime overhead.
Activations are counted in plan/memory/activations.py.
"""


from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from fivefold.plan.cached_hash import HashedTuple
from fivefold.plan.memory.activations import activation_fields, ranks_activation_bytes
from fivefold.plan.memory.framework import as_recomputed_by, as_run_by, process_bytes
from fivefold.plan.hardware import Hardware, Runtime
from fivefold.plan.layout import Layout, replaced
from fivefold.plan.lora import adapter_param_counts, layer_adapter_params
from fivefold.plan.model_stats import ModelStats
from fivefold.plan.pipeline.schedule import V_SHAPED, PipelineRank, _pipeline_ranks, chunks_per_rank, stage_shape
from fivefold.plan.workload import Workload


@dataclass
class MemoryBreakdown:
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    other: float = 0.0
    pipeline_rank: int = 0
    detail: dict = field(default_factory=dict)
    # Of `other`: what the process holds outside PyTorch's caching allocator (the CUDA context,
    # NCCL's buffers: plan/memory/framework.py), which torch.cuda's peak-memory figures leave out.
    outside_allocator: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.other

    @property
    def allocated(self) -> float:
        """The peak as torch.cuda.max_memory_allocated reports it: the total less the process's
        context and communication buffers."""
        return self.total - self.outside_allocator

    def to_dict(self) -> dict:
        keys = ("params", "grads", "optimizer", "activations", "other")
        out = {k: int(round(getattr(self, k))) for k in keys}
        out["total"] = sum(out.values())
        return out


# ----------------------------------------------------------------------------------- parameters

def layer_param_counts(stats: ModelStats, layout: Layout, layer: int) -> tuple[float, float]:
    """(dense, expert) parameters of one layer held by one rank. A MoE layer's weights are
    replicated over tp (parallel/tensor/apply.py; its tokens are split): each tp rank holds the router,
    the shared experts and its ep share of the routed experts whole; so does latent attention its
    down-projections and their norms."""
    t = layout.tp
    dense = (stats.attention_params - stats.latent_params) / t + stats.latent_params + stats.norm_params
    if layer >= stats.n_layers:  # multi-token prediction: eh_proj and three norms, whole on every tp rank
        dense += 2 * stats.dim * stats.dim + 3 * stats.dim
    if not stats.is_moe(layer):
        return dense + stats.dense_mlp_params / t, 0.0
    dense += stats.router_params + stats.shared_expert_params
    return dense, stats.n_experts / layout.ep * stats.expert_params


def rank_param_counts(stats: ModelStats, layout: Layout, prank: PipelineRank) -> tuple[float, float]:
    """(dense, expert) parameters held by one rank of this pipeline rank, before ZeRO sharding."""
    return _rank_param_counts(stats, layout.tp, layout.ep, prank.kinds, prank.has_embedding, prank.has_output)


@lru_cache(maxsize=16384)
def _rank_param_counts(stats: ModelStats, tp: int, ep: int, kinds: tuple, has_embedding: bool,
                       has_output: bool) -> tuple[float, float]:
    """rank_param_counts by what it depends on (the search asks for the same stage at every dp,
    ZeRO stage and recomputation: computed once)."""
    layout = Layout(tp=tp, ep=ep)
    dense = experts = 0.0
    for layer, count in kinds:
        d, e = layer_param_counts(stats, layout, layer)
        dense += count * d
        experts += count * e
    prank = PipelineRank((), has_embedding, has_output)
    return dense + root_params(stats, layout, prank), experts


def muon_param_counts(stats: ModelStats, layout: Layout, prank: PipelineRank) -> tuple[float, float]:
    """(dense, expert) parameters of this rank that Muon updates under train.optimizer = muon with
    the default groups: the blocks' matrices, not their norms (nor multi-token prediction's eh_proj
    and norms, nor the embedding, output and final norm). Biases, attention sinks and latent
    attention's two norms are counted with the matrices (a few thousand elements a layer);
    train.param_groups moving a kind to AdamW is not followed."""
    dense = experts = 0.0
    for layer, count in prank.kinds:
        d, e = layer_param_counts(stats, layout, layer)
        vectors = stats.norm_params + (2 * stats.head_dim / layout.tp if stats.qk_norm else 0)
        if layer >= stats.n_layers:
            vectors += 2 * stats.dim * stats.dim + 3 * stats.dim
        dense += count * (d - vectors)
        experts += count * e
    return dense, experts


def root_params(stats: ModelStats, layout: Layout, prank: PipelineRank) -> float:
    """Parameters outside the transformer blocks on this rank: embedding, final norm, output (and
    multi-token prediction's copy of the embedding on a last stage without the first)."""
    table = stats.vocab_size * stats.dim / layout.tp  # vocab-parallel embedding / output projection
    root = table if prank.has_embedding else 0.0
    if prank.has_output:
        root += stats.dim  # final norm
        # A tied output projection shares the embedding's storage only on the rank holding both.
        if not (stats.tie_embeddings and prank.has_embedding):
            root += table
        if stats.mtp_depth and not prank.has_embedding and not stats.tie_embeddings:
            root += table
    return root


def expert_shard_degree(layout: Layout) -> int:
    """Ranks an expert's ZeRO-sharded state is split over: the ranks that hold the same experts,
    dp x cp x tp over ep (mesh.py: ep borrows from dp·cp·tp, and the tp ranks holding the same
    experts, which route different tokens, reduce and shard their gradients together) — under
    HSDP too: experts are sharded across the replicas as well, not only inside a dp_shard group.
    Without expert parallelism the experts are dense weights, sharded as they are."""
    if layout.ep == 1:
        return layout.shard_degree
    return max(1, layout.dp * layout.cp * layout.tp // layout.ep)


def as_trained(layout: Layout) -> Layout:
    """The layout the trainer runs: with dp·cp = 1 there is nothing to shard, so it ignores
    parallel.zero (and says so: config/validate.py ignored_options) and holds what zero 0 holds."""
    if layout.zero and layout.dp * layout.cp == 1:
        return replaced(layout, zero=0)
    return layout


def sharded_params(layout: Layout, dense: float, experts: float) -> float:
    """This rank's share of its (dense, expert) parameters once ZeRO shards them."""
    return dense / layout.shard_degree + experts / expert_shard_degree(layout)


def master_chunk_bytes(workload: Workload, layout: Layout, dense: float, experts: float) -> float:
    """fp32 master weights kept apart from the weights (parallel/data/zero.py), held from
    construction on, unlike gradients and moments: bf16's masters (whole at ZeRO-0, the owned chunk
    at ZeRO-1/2) and fp32 ZeRO-1/2's copy of its chunk. At ZeRO-3 the fp32 shards are the weights."""
    pr, layout = workload.precision, as_trained(layout)
    if layout.zero >= 3:
        return 0.0
    if layout.zero == 0:
        return pr.master_bytes * (dense + experts)
    return (pr.shard_master_bytes + pr.master_bytes) * sharded_params(layout, dense, experts)


def model_state_bytes(workload: Workload, layout: Layout, dense: float, experts: float,
                      muon: tuple[float, float] = (0.0, 0.0)) -> dict:
    """params / grads / optimizer bytes under the ZeRO stage (Rajbhandari et al. 2019); `muon`: the
    (dense, expert) parameters among them that Muon updates, one moment fewer (muon_param_counts)."""
    pr, layout = workload.precision, as_trained(layout)
    sharded = sharded_params(layout, dense, experts)
    whole = dense + experts
    one_moment = sharded_params(layout, *muon) if layout.zero >= 1 else sum(muon)
    z = layout.zero
    masters = master_chunk_bytes(workload, layout, dense, experts)
    # fp32 ZeRO-1 keeps the whole gradients until the step and receives its reduced chunk beside
    # them; bf16's chunk gradient is a view of its gradient buffer, ZeRO-2's chunks its only gradients.
    chunk_grads = pr.shard_master_bytes * sharded if z == 1 else 0
    return {
        "params": (pr.shard_param_bytes or pr.param_bytes) * sharded if z >= 3 else pr.param_bytes * whole,
        "grads": (pr.grad_bytes + pr.accum_bytes) * (sharded if z >= 2 else whole) + chunk_grads,
        "optimizer": pr.optim_bytes * (sharded if z >= 1 else whole) - pr.moment_bytes * one_moment + masters,
    }


def rank_state_bytes(workload: Workload, layout: Layout, prank: PipelineRank) -> dict:
    """params / grads / optimizer bytes of one rank of this pipeline rank: under Muon its matrices'
    one moment; under LoRA the frozen base's weights as the recipe stores them and nothing else,
    the adapters, the weights it trains, with gradients, AdamW's state and masters (plan/lora.py).
    Computed once per the degrees it reads (not recomputation or the schedule: a search asks for
    each at every recomputation); the dict is shared, read it only."""
    return _rank_state_bytes(workload, state_degrees(layout), prank)


def state_degrees(layout: Layout) -> tuple:
    """The layout fields a rank's model state reads (rank_state_bytes' key)."""
    return layout.dp, layout.zero, layout.tp, layout.cp, layout.ep, layout.dp_shard


@lru_cache(maxsize=16384)
def _rank_state_bytes(workload: Workload, degrees: tuple, prank: PipelineRank) -> dict:
    dp, zero, tp, cp, ep, dp_shard = degrees
    layout = Layout(dp=dp, zero=zero, tp=tp, cp=cp, ep=ep, dp_shard=dp_shard)
    stats, lora = workload.stats, workload.lora
    dense, experts = rank_param_counts(stats, layout, prank)
    if not lora.rank:
        muon = muon_param_counts(stats, layout, prank) if workload.muon else (0.0, 0.0)
        return model_state_bytes(workload, layout, dense, experts, muon)
    state = model_state_bytes(workload, layout, *adapter_param_counts(stats, layout, prank, lora))
    state["params"] += model_state_bytes(workload, layout, dense, experts)["params"]
    return state


# ---------------------------------------------------------------------------------- activations

def rank_memory(workload: Workload, layout: Layout, hw: Hardware, runtime: Runtime,
                prank: PipelineRank, rank: int) -> MemoryBreakdown:
    shared = _LayoutShared(workload, layout, hw, runtime)
    return shared.breakdown(prank, rank, *shared.ranks_parts(((rank, prank),))[0])


class _LayoutShared:
    """What every pipeline rank of one layout shares, worked out once for all of them: the
    workload as the framework holds its gradients, the layout as it trains and recomputes, its
    micro-batches, the bytes outside the allocator and the memo keys of its state and activations."""

    def __init__(self, workload: Workload, layout: Layout, hw: Hardware, runtime: Runtime):
        self.workload = as_run_by(workload, runtime)  # the framework's gradient buffer (plan/memory/framework.py)
        self.layout = as_trained(as_recomputed_by(layout, runtime, hw, self.workload.stats))
        self.hw, self.runtime = hw, runtime
        self.micro_batches = self.layout.micro_batches(self.workload.global_batch)
        self.outside = process_bytes(self.layout, hw)
        self.fixed = self.outside + runtime.fixed_bytes  # framework_memory.fixed_bytes

    def ranks_parts(self, ranks: tuple) -> list[tuple[dict, float, float]]:
        """(model state dict, saved activations, other bytes) of each of `ranks` ((index, rank)
        pairs). Each part is looked up once for the whole set: a search meets the same set of
        ranks at every ZeRO stage (activations) and every recomputation (state)."""
        workload, layout = self.workload, self.layout
        states = _states(workload, state_degrees(layout), ranks)
        activations = ranks_activation_bytes(workload, activation_fields(layout), ranks, self.micro_batches,
                                             self.hw, self.runtime)
        parts = [(state, saved, self.fixed + working) for state, (saved, working) in zip(states, activations)]
        if layout.zero < 3:
            return parts
        held = _fsdp_held(workload, (layout.tp, layout.ep, layout.pp, layout.split_backward), ranks)
        for i, terms in enumerate(held):
            state, saved, other = parts[i]
            for term in terms:  # added one by one, as a rank's other bytes always were
                other += term
            parts[i] = (state, saved, other)
        return parts

    def breakdown(self, prank: PipelineRank, rank: int, state: dict, saved: float,
                  other: float) -> MemoryBreakdown:
        params = sum(rank_param_counts(self.workload.stats, self.layout, prank))
        return MemoryBreakdown(params=state["params"], grads=state["grads"],
                               optimizer=state["optimizer"], activations=saved, other=other,
                               pipeline_rank=rank, outside_allocator=self.outside,
                               detail={"params_per_rank": params, "layers": len(prank.layers)})


@lru_cache(maxsize=16384)
def _states(workload: Workload, degrees: tuple, ranks: tuple) -> tuple[dict, ...]:
    return tuple(_rank_state_bytes(workload, degrees, prank) for _, prank in ranks)


@lru_cache(maxsize=4096)
def _fsdp_held(workload: Workload, fields: tuple, ranks: tuple) -> tuple[tuple[float, ...], ...]:
    """What each rank holds at ZeRO-3 beyond its shards, gathered or not yet reduced (FSDP), term by term."""
    tp, ep, pp, split_backward = fields
    layout, stats, pr, lora = Layout(tp=tp, ep=ep), workload.stats, workload.precision, workload.lora
    held = []
    for _, prank in ranks:
        terms = []
        if prank.layers:
            dense, experts = rank_param_counts(stats, layout, prank)
            trained = adapter_param_counts(stats, layout, prank, lora) if lora.rank else (dense, experts)
            # FSDP all-gathers one layer while the previous one computes (prefetch): two unsharded
            # layers of weights, plus one layer's unsharded gradient before its reduce-scatter.
            layer = max(sum(layer_param_counts(stats, layout, i)) for i, _ in prank.kinds)
            grads = (max(sum(layer_adapter_params(stats, layout, i, lora)) for i, _ in prank.kinds)
                     if lora.rank else layer)  # a frozen weight has no gradient
            terms.append(layer * 2 * pr.param_bytes + grads * pr.reduce_bytes)
            if pp > 1:
                # PyTorch's pipeline stage reduce-scatters once, after the step's last backward: the
                # stage's unsharded gradients accumulate until then.
                terms.append(sum(trained) * pr.reduce_bytes)
            if split_backward:  # blocks stay gathered from forward to backward (parallel/data/fsdp.py)
                terms.append((dense + experts) * pr.param_bytes)
        held.append(tuple(terms))
    return tuple(held)


def candidate_ranks(workload: Workload, layout: Layout) -> tuple[tuple[int, PipelineRank], ...]:
    """The pipeline ranks that can hold the most. Ranks of the same stage shape differ only in
    their in-flight micro-batches (plan/pipeline/schedule.py in_flight_per_chunk), and their memory is
    linear in each chunk's count with positive weights. Outside the V-shaped schedules the counts
    only fall with the rank's index: the first rank of each shape holds at least what the later
    ones do. Under ZB-V and DualPipe-V the first chunk's count falls and the second's rises with
    the index, each clipped at m: memory is concave and piecewise linear in the index, with kinks
    where a count meets m, so its maximum over a shape's ranks is at the first or last rank of a
    linear piece. (The search meets ~10^4 layouts at 8,192 GPUs: this keeps it near a second.)"""
    return _candidate_ranks(workload, layout.pp, chunks_per_rank(layout), layout.pp_schedule, layout.pp_layers,
                            layout.micro_batches(workload.global_batch))


@lru_cache(maxsize=8192)
def _candidate_ranks(workload: Workload, p: int, v: int, schedule: str, pp_layers: str,
                     m: int) -> tuple[tuple[int, PipelineRank], ...]:
    """candidate_ranks by what they depend on, the pipeline's shape (not dp, tp or ZeRO)."""
    return HashedTuple(_candidate_rank_pairs(workload, p, v, schedule, pp_layers, m))


def _candidate_rank_pairs(workload: Workload, p: int, v: int, schedule: str, pp_layers: str,
                          m: int) -> tuple[tuple[int, PipelineRank], ...]:
    stats = workload.stats
    ranks = _pipeline_ranks(stats, p, v, schedule in V_SHAPED, pp_layers, workload.seq_len)
    if len(ranks) <= 2 or any(not chunk for prank in ranks for chunk in prank.chunks):
        return tuple(enumerate(ranks))  # (a stage without layers holds outputs, not activations)
    groups: dict[tuple, list[int]] = {}
    for r, prank in enumerate(ranks):
        groups.setdefault(stage_shape(stats, prank), []).append(r)
    if schedule not in V_SHAPED:
        return tuple((r, ranks[r]) for r in sorted(members[0] for members in groups.values()))
    kinks = (2 * p - 1 - m, 2 * p - m, m - 1)  # zbv: 2p-1-r and r+1 meet m; dualpipev: 2p-r
    keep = set()
    for members in groups.values():
        pieces: dict[int, list[int]] = {}
        for r in members:
            pieces.setdefault(sum(r > k for k in kinks), []).append(r)
        for piece in pieces.values():
            keep.update((piece[0], piece[-1]))
    return tuple((r, ranks[r]) for r in sorted(keep))


def worst_rank_memory(workload: Workload, layout: Layout, hw: Hardware,
                      runtime: Runtime) -> MemoryBreakdown:
    """Peak memory of the pipeline rank that needs the most (first rank: most activations in
    flight and the embedding; last rank: output projection and logits); of ranks needing the same,
    the first. Only that rank's breakdown is built: the others are compared by their totals,
    summed as MemoryBreakdown.total sums them."""
    shared = _LayoutShared(workload, layout, hw, runtime)
    ranks = candidate_ranks(workload, layout)
    worst = worst_total = None
    for (r, prank), parts in zip(ranks, shared.ranks_parts(ranks)):
        state, saved, other = parts
        total = state["params"] + state["grads"] + state["optimizer"] + saved + other
        if worst is None or total > worst_total:
            worst, worst_total = (prank, r, parts), total
    prank, r, parts = worst
    return shared.breakdown(prank, r, *parts)


class RankTotals:
    """One layout's rank totals under any stage split, by (index, stage shape): a rank's bytes read
    its index (in-flight micro-batches), its shape (ends, sends, each chunk's layer kinds) and the
    layout's fields, not the split. Under LoRA, whose adapters may be chosen by a layer's name, by
    the rank's layers themselves. plan/search.py end_relieved prices each tried split with it: a
    rank the split leaves as it was (most of them) is not sized again."""

    def __init__(self, workload: Workload, layout: Layout, hw: Hardware, runtime: Runtime):
        self.workload, self.cap = workload, hw.memory_bytes
        self.shared = _LayoutShared(workload, layout, hw, runtime)  # reads no pp_layers
        self.totals: dict = {}
        self.balanced = []  # (index, total) of the layout's own split's candidate ranks
        ranks = candidate_ranks(workload, layout)
        for (r, prank), parts in zip(ranks, self.shared.ranks_parts(ranks)):  # memo hits
            self.totals[self._key(r, prank)] = _total(parts)
            self.balanced.append((r, _total(parts)))

    def _key(self, r: int, prank: PipelineRank) -> tuple:
        return r, (prank if self.workload.lora.rank else stage_shape(self.workload.stats, prank))

    def total(self, r: int, prank: PipelineRank) -> float:
        key = self._key(r, prank)
        if key not in self.totals:
            self.totals[key] = _total(self.shared.ranks_parts(((r, prank),))[0])
        return self.totals[key]

    def worst_if_fits(self, split: Layout, end: int) -> MemoryBreakdown | None:
        """worst_rank_memory of `split` (this layout with other pp_layers), or None as soon as a
        rank overflows: the ranks known first, then the end `end`, then the rest."""
        ranks = candidate_ranks(self.workload, split)
        order = sorted(ranks, key=lambda rp: (self._key(*rp) not in self.totals, rp[0] != end))
        if any(self.total(r, prank) > self.cap for r, prank in order):
            return None
        r, prank = max(ranks, key=lambda rp: (self.total(*rp), -rp[0]))  # the first of the largest
        return self.shared.breakdown(prank, r, *self.shared.ranks_parts(((r, prank),))[0])


def _total(parts: tuple) -> float:
    """A rank's total from its (state, saved, other) parts, summed as MemoryBreakdown.total sums."""
    state, saved, other = parts
    return state["params"] + state["grads"] + state["optimizer"] + saved + other
