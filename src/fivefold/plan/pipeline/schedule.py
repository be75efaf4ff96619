"""Pipeline facts: which layers each pipeline rank holds, how many micro-batches of activations a
schedule keeps in flight, and how long its bubble is.

Sources: GPipe/1F1B bubble (p-1)/m and interleaved (p-1)/(v m) (Narayanan et al. 2021); in-flight
activations under 1F1B and interleaving (Korthikanti et al. 2022); ZB-H1 / ZB-V (Qi et al. 2023,
arXiv 2401.10241); DualPipe(V) (DeepSeek-V3 report, 2024).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from fivefold.plan.cached_hash import HashedTuple, cached_hash, state_without_hash
from fivefold.plan.pipeline.stage_split import balanced_layer_counts
from fivefold.plan.layout import Layout
from fivefold.plan.model_stats import ModelStats

V_SHAPED = ("zbv", "dualpipev")  # two chunks per rank, placed first-down then back up


def chunks_per_rank(layout: Layout) -> int:
    if layout.pp == 1:
        return 1
    if layout.pp_schedule in V_SHAPED:
        return 2
    # interleaved_1f1b and zb (torch's interleaved zero-bubble schedule) run pp_virtual stages
    return layout.pp_virtual if layout.pp_schedule in ("interleaved_1f1b", "zb") else 1


@dataclass(frozen=True)
class PipelineRank:
    __hash__ = cached_hash  # computed once: the search's memo tables are keyed by it
    __getstate__ = state_without_hash

    layers: tuple[int, ...]  # transformer layers this rank holds (all its chunks)
    has_embedding: bool
    has_output: bool  # final norm + output projection + loss
    # (a representative layer, how many) for each kind of layer (dense, MoE, multi-token
    # prediction) the rank holds:
    # layers of a kind are identical, so per-layer quantities are computed once per kind.
    kinds: tuple[tuple[int, int], ...] = ()
    moe_layers: int = 0
    # The layers of each of the rank's chunks (stages), in stage order, and whether each sends its
    # output to another rank (not the last stage, nor a V's turning stage, whose next is local).
    chunks: tuple[tuple[int, ...], ...] = ()
    sends: tuple[bool, ...] = ()


def _rank(stats: ModelStats, layers: tuple[int, ...], first: bool, last: bool,
          chunks: tuple[tuple[int, ...], ...] = (), sends: tuple[bool, ...] = ()) -> PipelineRank:
    main = [i for i in layers if i < stats.n_layers]
    # Dense and MoE layers, each split into full-attention and sliding-window ones (their FLOPs differ).
    groups = [[i for i in main if stats.is_moe(i) == moe and (i in stats.sliding_layers) == sliding]
              for moe in (False, True) for sliding in (False, True)]
    mtp = [i for i in layers if i >= stats.n_layers]  # multi-token prediction's blocks: a kind of their own
    kinds = tuple((group[0], len(group)) for group in (*groups, mtp) if group)
    n_moe = sum(stats.is_moe(i) for i in layers)
    return PipelineRank(layers, first, last, kinds, n_moe, chunks or (layers,), sends or (False,))


@lru_cache(maxsize=4096)
def parse_pp_layers(text: str, n_chunks: int, n_layers: int) -> tuple[int, ...]:
    """'7,9,9,7' -> (7, 9, 9, 7), checked against the chunk count and the model's layers."""
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"pp_layers='{text}' must be comma-separated layer counts, e.g. 7,9,9,7") from None
    if len(sizes) != n_chunks or sum(sizes) != n_layers or min(sizes) < 0:
        raise ValueError(f"pp_layers='{text}' must give {n_chunks} non-negative layer counts "
                         f"adding up to model.n_layers={n_layers}")
    return sizes


# Layers taken off the pipeline's first and last chunk, in the order the search tries them.
END_RELIEFS = ((1, 0), (1, 1), (2, 1), (2, 2), (3, 2), (3, 3))


@lru_cache(maxsize=1024)
def balanced_sizes(stats: ModelStats, n_chunks: int, seq_len: int) -> tuple[int, ...]:
    """The trainer's own split when parallel.pp_layers is empty: layers balanced by FLOPs, the
    output layer counted with the last chunk (plan/pipeline/stage_split.py)."""
    costs = [stats.layer_flops_per_token(i, seq_len) for i in range(stats.n_layers)]
    return tuple(balanced_layer_counts(costs, stats.head_flops_per_token(seq_len), n_chunks))


def end_relieved_splits(stats: ModelStats, layout: Layout, seq_len: int) -> tuple[tuple[str, int, int], ...]:
    """(pp_layers text, layers off the first chunk, off the last) for splits that give the ends of
    the pipeline fewer layers than the FLOP-balanced one (Llama 3 trained with one layer fewer on
    each): the first chunk keeps the most micro-batches in flight and the embedding, the last the
    output layer and the loss. Their layers go to the middle chunks, nearest the middle first."""
    return _end_relieved_splits(stats, layout.pp * chunks_per_rank(layout), seq_len)


@lru_cache(maxsize=1024)
def _end_relieved_splits(stats: ModelStats, n_chunks: int, seq_len: int) -> tuple[tuple[str, int, int], ...]:
    if n_chunks < 3:
        return ()
    base = balanced_sizes(stats, n_chunks, seq_len)
    middle = sorted(range(1, n_chunks - 1), key=lambda c: abs(c - (n_chunks - 1) / 2))
    splits = []
    for first, last in END_RELIEFS:
        if base[0] - first < 1 or base[-1] - last < 1:
            break
        sizes = list(base)
        sizes[0] -= first
        sizes[-1] -= last
        for i in range(first + last):
            sizes[middle[i % len(middle)]] += 1
        splits.append((",".join(map(str, sizes)), first, last))
    return tuple(splits)


def pipeline_ranks(stats: ModelStats, layout: Layout, seq_len: int) -> list[PipelineRank]:
    """Layers of each pipeline rank: layout.pp_layers when given, else balanced by FLOPs (what
    fivefold does when parallel.pp_layers is empty)."""
    v_shaped = layout.pp_schedule in V_SHAPED
    return list(_pipeline_ranks(stats, layout.pp, chunks_per_rank(layout), v_shaped,
                                layout.pp_layers, seq_len))


@lru_cache(maxsize=1024)
def _pipeline_ranks(stats: ModelStats, p: int, v: int, v_shaped: bool, pp_layers: str,
                    seq_len: int) -> tuple[PipelineRank, ...]:
    mtp = tuple(stats.mtp_layers)  # multi-token prediction: after the last layer, on the last stage
    if p == 1:
        return HashedTuple((_rank(stats, tuple(range(stats.n_layers)) + mtp, True, True),))
    n_chunks = p * v
    if pp_layers:
        sizes = parse_pp_layers(pp_layers, n_chunks, stats.n_layers)
    else:  # the trainer's own split (same costs, same algorithm): predictions hold what runs
        sizes = balanced_sizes(stats, n_chunks, seq_len)
    bounds, start = [], 0
    for size in sizes:
        bounds.append(tuple(range(start, start + size)))
        start += size
    bounds[-1] += mtp
    if v_shaped:
        owner = [c if c < p else 2 * p - 1 - c for c in range(n_chunks)]
    else:
        owner = [c % p for c in range(n_chunks)]
    ranks = []
    for r in range(p):
        mine = [c for c in range(n_chunks) if owner[c] == r]
        layers = tuple(i for c in mine for i in bounds[c])
        sends = tuple(c < n_chunks - 1 and owner[c + 1] != r for c in mine)
        ranks.append(_rank(stats, layers, 0 in mine, n_chunks - 1 in mine,
                           tuple(bounds[c] for c in mine), sends))
    return HashedTuple(ranks)  # memo tables downstream are keyed by it (plan/pipeline/rank_kinds.py)


@lru_cache(maxsize=16384)
def stage_shape(stats: ModelStats, prank: PipelineRank) -> tuple:
    """What a pipeline rank's memory depends on besides its in-flight micro-batches: its ends
    (embedding, output), which chunks send, and the kind of each layer of each chunk. (Memoised:
    plan/memory/peak.py RankTotals keys every rank of every relieved split by it.)"""
    def kind(i):
        return stats.is_moe(i), i in stats.sliding_layers, i >= stats.n_layers
    return (prank.has_embedding, prank.has_output, prank.sends,
            tuple(tuple(kind(i) for i in chunk) for chunk in prank.chunks))


@lru_cache(maxsize=1024)
def ranks_kept_by_relief(stats: ModelStats, p: int, v: int, v_shaped: bool, seq_len: int,
                         by_layers: bool) -> frozenset:
    """Indices of the pipeline ranks whose stage shape (by_layers: whose layers) every split of
    _end_relieved_splits leaves as the balanced split has it: those holding neither end nor a
    middle chunk that takes the ends' layers."""
    def ranks(text):
        return [prank if by_layers else stage_shape(stats, prank)
                for prank in _pipeline_ranks(stats, p, v, v_shaped, text, seq_len)]
    balanced = ranks("")
    kept = set(range(p))
    for text, _, _ in _end_relieved_splits(stats, p * v, seq_len):
        kept -= {r for r, shape in enumerate(ranks(text)) if shape != balanced[r]}
    return frozenset(kept)


def in_flight_chunks(layout: Layout, rank: int, micro_batches: int) -> float:
    """Micro-batches whose activations rank `rank` holds at its peak, in units of one micro-batch
    through all of that rank's layers (chunks of equal size)."""
    return sum(in_flight_per_chunk(layout, rank, micro_batches)) / chunks_per_rank(layout)


def in_flight_per_chunk(layout: Layout, rank: int, micro_batches: int) -> tuple[int, ...]:
    """For each of rank `rank`'s chunks (stage order), the micro-batches whose forward has run and
    whose backward has not finished at the rank's peak: the moment it has run the most forwards
    ahead of their backwards. Counted from the orders torch.distributed.pipelining's schedules
    run (checked against their action tables in tests/test_plan_activations.py):
      gpipe: every forward before any backward; 1f1b: p - rank warm-up forwards;
      interleaved_1f1b: (v-1)·g + 2(p-1-rank) warm-up forwards, g micro-batches a round, cycling
          through the chunks, then one more before the first backward;
      zb (torch's interleaved zero bubble): its input-gradient pass keeps the graph for the
          weight pass, so (v-1)·g + p forwards, on every rank;
      zbv: the first chunk 2p-1-rank, the second rank+1; dualpipev: 2p-rank and rank+1."""
    return _in_flight_per_chunk(layout.pp, micro_batches, chunks_per_rank(layout), layout.pp_schedule, rank)


@lru_cache(maxsize=16384)
def _in_flight_per_chunk(p: int, m: int, v: int, sched: str, rank: int) -> tuple[int, ...]:
    """in_flight_per_chunk by what it reads (a search asks for the same ranks of a pipeline at
    every dp, tp, ZeRO stage and recomputation)."""
    if p == 1:
        return (1,)
    if sched == "gpipe":
        return (m,)
    if sched == "1f1b":
        return (min(p - rank, m),)
    if sched in ("interleaved_1f1b", "zb"):
        per_round = m // max(1, m // p)  # torch's microbatches_per_round
        ahead = ((v - 1) * per_round + 2 * (p - 1 - rank) + 1 if sched == "interleaved_1f1b"
                 else (v - 1) * per_round + p)
        ahead = min(ahead, m * v)
        counts = [0] * v
        for k in range(ahead):  # forward k runs chunk (k // per_round) % v
            counts[(k // per_round) % v] += 1
        return tuple(counts)
    if sched == "zbv":
        return (min(2 * p - 1 - rank, m), min(rank + 1, m))
    if sched == "dualpipev":
        return (min(2 * p - rank, m), min(rank + 1, m))
    raise ValueError(sched)


def outputs_held(layout: Layout, in_flight: int, micro_batches: int) -> int:
    """Stage outputs a sending chunk still holds at the peak (parallel/pipeline/stages.py): each in-flight
    micro-batch's until its backward has run; under Schedule1F1B, which lets go of a send one
    micro-batch later, the newest output, the one before and, once the steady phase has begun, the
    last warm-up send but one, whose work it keeps to the end."""
    if layout.pp_schedule != "1f1b":
        return in_flight
    return min(in_flight, 2) + (1 if micro_batches > in_flight >= 2 else 0)


def bubble_slots(layout: Layout, micro_batches: int) -> float:
    """Idle time of a step in units of one micro-batch's forward+backward on the slowest rank."""
    p, m, v = layout.pp, micro_batches, chunks_per_rank(layout)
    if p == 1:
        return 0.0
    sched = layout.pp_schedule
    if sched in ("gpipe", "1f1b"):
        return float(p - 1)
    if sched == "interleaved_1f1b":
        return (p - 1) / v
    if sched == "zb":
        return (p - 1) / 3  # ZB-H1: (p-1)(F+B-2W) with F = B = W
    if sched == "zbv":
        return 0.0 if m >= 2 * p else (p - 1) / 3  # ZB-V needs m >= 2p to fill its bubble
    if sched == "dualpipev":
        # DualPipe: (p/2-1)(F&B + B - 3W), B the full backward: with F = W = B/2 = T and F&B
        # taking F + B (no overlap credit) that is T (p-2), i.e. (p-2)/3 micro-batch slots.
        return max(0.0, (p - 2) / 3)
    raise ValueError(sched)


def bubble_fraction(layout: Layout, micro_batches: int) -> float:
    """Share of the pipeline's step time that is bubble."""
    slots = bubble_slots(layout, micro_batches)
    return slots / (micro_batches + slots) if slots else 0.0
