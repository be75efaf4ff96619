"""Find the best layout for a model on a cluster: enumerate valid layouts, drop those that do not
fit (keeping the reason), rank the rest by predicted tokens/s per GPU, and explain the ranking.

Pruning keeps a search over thousands of GPUs under a second: for each choice of degrees,
schedule and micro-batch size, recomputation only trades time for memory, so each ZeRO stage is
timed with the cheapest recomputation that fits. The search checks the divisibility rules by
construction and validates only its winners with the training code's full rules.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from fivefold.config import Config, ConfigError
from fivefold.config.pipeline_rules import micro_batch_problem, pipeline_problem
from fivefold.plan.estimate import Estimate, estimate
from fivefold.plan.hardware import Hardware, Runtime
from fivefold.plan.layout import Layout, config_with_layout, replaced
from fivefold.plan.memory.peak import RankTotals, worst_rank_memory
from fivefold.plan.pipeline.schedule import (END_RELIEFS, V_SHAPED, chunks_per_rank, end_relieved_splits,
                                             ranks_kept_by_relief)
from fivefold.plan.workload import Workload
from fivefold.config.validate import ignored_options
from fivefold.configure import validate

GB = 1e9
GiB = 2 ** 30  # memory is stated in GiB (what nvidia-smi and torch.cuda report), with GB where it helps
RECOMPUTE_ORDER = ("none", "selective", "full")  # fastest first
SEARCH_SCHEDULES = ("1f1b", "interleaved_1f1b", "zb", "zbv")


@dataclass
class Rejected:
    layout: Layout
    reason: str


@dataclass
class SearchResult:
    ranked: list[Estimate]
    rejected: list[Rejected] = field(default_factory=list)  # the first few, with reasons
    evaluated: int = 0
    n_rejected: int = 0
    # Layouts that fit only with the pipeline's ends given fewer layers: layout -> why (end_relieved)
    split_notes: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------ checking

def layout_problem(cfg: Config, workload: Workload, layout: Layout, world: int | None,
                   full_check: bool = True) -> str | None:
    """Why this layout cannot run at all (one sentence), or None.

    full_check runs the training code's own rules (fivefold.configure.validate) on the config with this
    layout; the search enumerates only layouts that already satisfy the divisibility rules, so
    it checks just what depends on the batch and the pipeline, and validates its winners."""
    if full_check:
        try:
            validate(config_with_layout(cfg, layout), world)
        except ConfigError as err:
            return str(err)
    if layout.mbs * layout.dp > workload.global_batch:
        return (f"mbs={layout.mbs} x dp={layout.dp} exceeds train.global_batch="
                f"{workload.global_batch}; lower mbs or dp")
    if layout.tp > 1 and layout.sp and workload.seq_len % (layout.tp * layout.cp):
        return (f"train.seq_len={workload.seq_len} is not divisible by tp*cp="
                f"{layout.tp * layout.cp}, which sequence parallelism needs")
    # The pipeline's rules are the trainer's own (config/pipeline_rules.py), asked with numbers.
    stats, train = workload.stats, cfg.train
    problem = pipeline_problem(layout.pp, layout.pp_virtual, layout.pp_schedule, stats.n_layers,
                               layout.pp_layers, layout.recompute, train.eval_every, stats.mtp_depth,
                               stats.tie_embeddings)
    return problem or micro_batch_problem(layout.pp, layout.pp_virtual, layout.pp_schedule,
                                          layout.micro_batches(workload.global_batch),
                                          "lower mbs or dp, or raise train.global_batch")


def memory_reason(est_or_memory, limit: float) -> str:
    mem = getattr(est_or_memory, "memory", est_or_memory)
    parts = {k: getattr(mem, k) for k in ("params", "grads", "optimizer", "activations", "other")}
    big = max(parts, key=parts.get)
    return (f"needs {mem.total / GiB:.1f} GiB ({mem.total / GB:.1f} GB) per GPU but has {limit / GiB:.1f} GiB "
            f"(pipeline rank {mem.pipeline_rank}; largest part {big} {parts[big] / GiB:.1f} GiB)")


# --------------------------------------------------------------------------------- enumeration

def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two_dividing(n: int, limit: int) -> list[int]:
    out, d = [], 1
    while d <= limit and n % d == 0:
        out.append(d)
        d *= 2
    return out


def field_options(key: str, fixed: dict, searched) -> list:
    """The search's options for a Layout field, or the one value `fixed` holds for it."""
    return [fixed[key]] if key in fixed else list(searched)


def degree_choices(cfg: Config, workload: Workload, gpus: int, gpus_per_node: int, fixed: dict | None = None):
    """(dp, tp, pp, cp, ep) tuples whose product fits the cluster. tp stays inside a node (the
    Playbook's runs show tensor parallelism across nodes never pays).

    A degree in `fixed` (Layout field -> value: the keys a user gave, plan/auto.py) keeps its
    value instead of taking the search's options; only the product has to fit, the rest of the
    search's pruning is left to the validator."""
    fixed = fixed or {}
    m, stats = cfg.model, workload.stats
    head_gcd = math.gcd(math.gcd(m.n_heads, m.n_kv_heads), math.gcd(m.ffn_dim, m.vocab_size))
    tps = [d for d in divisors(min(gpus_per_node, gpus)) if head_gcd % d == 0]
    for tp in field_options("tp", fixed, tps):
        if gpus % tp:
            continue
        cps = [c for c in _powers_of_two_dividing(gpus // tp, 16) if c == 1 or workload.seq_len // c >= 4096]
        for cp in field_options("cp", fixed, cps):
            if (gpus // tp) % cp:
                continue
            pps = [p for p in divisors(gpus // (tp * cp)) if p <= stats.n_layers]
            for pp in field_options("pp", fixed, pps):
                if (gpus // (tp * cp)) % pp:
                    continue
                dp = gpus // (tp * cp * pp)
                if fixed.get("dp", dp) != dp or workload.global_batch % dp:
                    continue
                # ep borrows its ranks from dp*cp, and beyond them from tp (mesh.py expert_groups).
                eps = [e for e in divisors(stats.n_experts) if (dp * cp * tp) % e == 0] if stats.n_experts else [1]
                for ep in field_options("ep", fixed, eps):
                    if (dp * cp * tp) % ep == 0:
                        yield dp, tp, pp, cp, ep


def without_ignored(layout: Layout) -> Layout:
    """The layout with every option it does nothing with back at its default, so that twins
    (e.g. dp1 z0 and dp1 z1) compare equal; the trainer reports the same options as ignored."""
    defaults = Layout()
    return dataclasses.replace(layout, **{k: getattr(defaults, k) for k in ignored_options(layout)})


def _schedules(pp: int, fixed: dict) -> list[tuple[str, int]]:
    """(pp_schedule, pp_virtual) pairs to try: two stages per rank for the schedules that need
    them (fivefold.configure.validate's rule; one for config/schedules.py's SINGLE_STAGE_SCHEDULES),
    unless pp_virtual is fixed."""
    if pp == 1:
        return [(fixed.get("pp_schedule", "1f1b"), fixed.get("pp_virtual", 1))]
    return [(s, fixed.get("pp_virtual", 1 if s in ("1f1b", "gpipe") else 2))
            for s in field_options("pp_schedule", fixed, SEARCH_SCHEDULES)]


@dataclass(frozen=True)
class LayoutGrid:
    """Layouts that differ only in ZeRO stage and recomputation: `one` at each of `zeros` and
    `recomputes` (fastest first). Iterating gives the rows, one per recomputation, each a list
    of layouts by ZeRO stage; `cheapest` builds only the layouts a search times."""
    one: Layout
    zeros: tuple
    recomputes: tuple

    @property
    def first(self) -> Layout:
        return replaced(self.one, zero=self.zeros[0], recompute=self.recomputes[0])

    def __iter__(self):
        return iter([[replaced(self.one, zero=z, recompute=r) for z in self.zeros]
                     for r in self.recomputes])

    def cheapest(self, settled: set):
        """The layouts worth timing, fastest recomputation first: a ZeRO stage in `settled` (the
        caller adds each that fits) fitted already with cheaper recomputation, and more
        recomputation only costs time. (A search builds ~10^4 layouts: each only when needed.)"""
        for recompute in self.recomputes:
            for zero in self.zeros:
                if zero not in settled:
                    yield replaced(self.one, zero=zero, recompute=recompute)
            if len(settled) == len(self.zeros):
                return


def candidate_layouts(cfg: Config, workload: Workload, gpus: int, gpus_per_node: int,
                      fixed: dict | None = None, base: Layout | None = None):
    """LayoutGrids: for each choice of degrees, micro-batch size, sequence parallelism and
    schedule, the layouts that differ only in ZeRO stage and recomputation.

    A Layout field in `fixed` keeps that value instead of taking the search's options (mbs 0: the
    whole per-rank batch, as train.micro_batch). `base` gives the fields the search does not
    choose (dp_shard, cp_method, pp_layers; sp where tp > 1); by default parallel.cp_method and
    sequence parallelism."""
    fixed = fixed or {}
    base = base or Layout(cp_method=cfg.parallel.cp_method)
    for dp, tp, pp, cp, ep in degree_choices(cfg, workload, gpus, gpus_per_node, fixed):
        per_rank = workload.global_batch // dp
        mbss = [fixed["mbs"] or per_rank] if "mbs" in fixed else _powers_of_two_dividing(per_rank, 8)
        # Sequence parallelism saves activation memory and, eager, costs a backward re-gather per
        # sub-layer (counted in plan/estimate.py; gloo's slower reduce-scatters are not, see
        # benchmarks/vs_picotron.py): both are candidates, sp first (less memory when as fast).
        sps = field_options("sp", fixed, (True, False)) if tp > 1 else [False]
        for mbs, sp in itertools.product(mbss, sps):
            for sched, virtual in _schedules(pp, fixed):
                one = dataclasses.replace(base, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, mbs=mbs, pp_schedule=sched,
                                          pp_virtual=virtual, sp=sp and tp > 1)
                # One of each set of twins: ZeRO stages that change nothing (dp·cp = 1) are one layout.
                shards = "zero" not in ignored_options(dataclasses.replace(one, zero=1))
                zeros = field_options("zero", fixed, (0, 1, 2, 3) if shards else (0,))
                yield LayoutGrid(one, tuple(zeros), tuple(field_options("recompute", fixed, RECOMPUTE_ORDER)))


# -------------------------------------------------------------------------------------- search

def search(cfg: Config, workload: Workload, hw: Hardware, runtime: Runtime, gpus: int,
           keep_rejected: int = 200) -> SearchResult:
    result = SearchResult(ranked=[])
    for grid in candidate_layouts(cfg, workload, gpus, hw.gpus_per_node):
        first = grid.first
        problem = layout_problem(cfg, workload, first, gpus, full_check=False)
        if problem:
            _reject(result, first, problem, keep_rejected)
            continue
        settled: set[int] = set()
        for layout in grid.cheapest(settled):
            mem = worst_rank_memory(workload, layout, hw, runtime)
            result.evaluated += 1
            if mem.total > hw.memory_bytes:
                relieved = end_relieved(workload, layout, hw, runtime, mem)
                if relieved is None:
                    _reject(result, layout, lambda: memory_reason(mem, hw.memory_bytes), keep_rejected)
                    continue
                layout, mem, note = relieved
                result.split_notes[layout] = note
            result.ranked.append(estimate(workload, layout, hw, runtime, mem))
            settled.add(layout.zero)
    rank(result.ranked)
    explain(result.ranked)
    for est in result.ranked:
        if est.layout in result.split_notes:
            est.why += f"; {result.split_notes[est.layout]}"
    return result


def end_relieved(workload: Workload, layout: Layout, hw: Hardware, runtime: Runtime, balanced):
    """A layout that does not fit with the FLOP-balanced stage split, with the first split that
    gives the pipeline's ends fewer layers and fits (plan/pipeline/schedule.py end_relieved_splits): (layout,
    its memory, why), or None."""
    if layout.pp == 1 or layout.pp_layers or balanced.pipeline_rank not in (0, layout.pp - 1):
        return None
    # Cheap bound first (the search meets thousands of layouts): a rank's per-layer bytes (all but
    # 'other') fall at most in proportion to the layers it gives up.
    most = max(first for first, _ in END_RELIEFS) / max(1, balanced.detail.get("layers", 1))
    if balanced.total - most * (balanced.total - balanced.other) > hw.memory_bytes:
        return None
    # A split moves a few layers from the ends to the middle chunks; every other rank keeps its
    # bytes, so one that overflows already rules all splits out, and each split sizes only the
    # ranks it changes (~1,500 layouts at 8,192 GPUs get here; 41 fit).
    known = RankTotals(workload, layout, hw, runtime)
    kept = ranks_kept_by_relief(workload.stats, layout.pp, chunks_per_rank(layout), layout.pp_schedule in V_SHAPED,
                                workload.seq_len, bool(workload.lora.rank))
    if any(total > hw.memory_bytes for r, total in known.balanced if r in kept):
        return None
    for text, first, last in end_relieved_splits(workload.stats, layout, workload.seq_len):
        relieved = replaced(layout, pp_layers=text)
        mem = known.worst_if_fits(relieved, balanced.pipeline_rank)
        if mem is not None:
            ends = " and ".join(f"the {end} stage {n} layer{'s' if n > 1 else ''} fewer"
                                for end, n in (("first", first), ("last", last)) if n)
            return relieved, mem, (f"stages {text} ({ends} than the FLOP-balanced split: "
                                   f"{mem.total / GiB:.1f} GiB per GPU instead of {balanced.total / GiB:.1f})")
    return None


def rank(estimates: list[Estimate]) -> None:
    """Fastest first; layouts within 0.5% of each other count as equally fast and the one needing
    less memory (more headroom for fragmentation and longer sequences) goes first."""
    estimates.sort(key=lambda e: (-round(math.log(e.tokens_per_sec_per_gpu) / math.log(1.005)),
                                  e.memory.total))


def reason_kind(reason: str) -> str:
    """What a rejection is about: memory, or the option its sentence names first."""
    return "memory" if reason.startswith("needs ") else reason.split("=")[0].split(" ")[0]


def main_reasons(rejected: list[Rejected], total: int = 0, most: int = 2) -> str:
    """The commonest kinds of rejection, most common first, each as one of its sentences with how
    many layouts it rejected (among the first len(rejected) of `total`): what to change, where the
    first rejection alone may name a schedule only some layouts tried."""
    kinds: dict[str, list[Rejected]] = {}
    for r in rejected:
        kinds.setdefault(reason_kind(r.reason), []).append(r)
    ranked = sorted(kinds.values(), key=lambda rs: -len(rs))[:most]
    among = f"the first {len(rejected)} of {total}" if total > len(rejected) else f"{len(rejected)}"
    return " and ".join(f'{len(rs)} of {among} layouts because "{rs[0].reason}"' for rs in ranked)


def _reject(result: SearchResult, layout: Layout, reason, keep: int) -> None:
    """Count a rejection and keep the first `keep` with their reason (a sentence, or a function
    making it: most rejections are only counted)."""
    result.n_rejected += 1
    if len(result.rejected) < keep:
        result.rejected.append(Rejected(layout, reason if isinstance(reason, str) else reason()))


# ------------------------------------------------------------------------------------- explain

_PART_NAMES = {"compute": "compute", "tp": "tensor-parallel communication",
               "cp": "context-parallel communication", "ep": "expert all-to-all",
               "pp": "pipeline sends", "host": "host launch overhead",
               "expert_imbalance": "waiting on the busiest expert rank", "bubble": "pipeline bubble",
               "dp": "data-parallel communication", "optimizer": "optimizer step",
               "newton_schulz": "Muon's Newton–Schulz", "muon_gather": "Muon's gathers of its matrices"}


def compare(a: Estimate, b: Estimate) -> str:
    """Why a is faster (or slower) than b, naming the two step-time parts that differ most."""
    diffs = {k: a.time_parts.get(k, 0.0) - b.time_parts.get(k, 0.0)
             for k in set(a.time_parts) | set(b.time_parts)}
    biggest = sorted(diffs, key=lambda k: -abs(diffs[k]))[:2]
    faster = a.tokens_per_sec_per_gpu / b.tokens_per_sec_per_gpu - 1
    if abs(faster) < 0.005:
        saved = (b.memory.total - a.memory.total) / GiB
        more_less = "less" if saved >= 0 else "more"
        return (f"as fast as {b.layout.short()} (within 0.5%) and needs {abs(saved):.1f} GiB "
                f"{more_less} memory per GPU")
    words = []
    for k in biggest:
        if abs(diffs[k]) < 1e-3 * max(a.step_time_s, 1e-9):
            continue
        more = "more" if diffs[k] > 0 else "less"
        words.append(f"{abs(diffs[k]):.3g} s {more} {_PART_NAMES.get(k, k)}")
    what = "faster" if faster >= 0 else "slower"
    reason = ", ".join(words) if words else "the same step-time parts"
    return f"{abs(faster):.1%} {what} than {b.layout.short()}: {reason} per step"


def explain(ranked: list[Estimate]) -> None:
    if not ranked:
        return
    if len(ranked) == 1:
        ranked[0].why = "the only layout that fits"
        return
    ranked[0].why = "best: " + compare(ranked[0], ranked[1])
    for est in ranked[1:]:
        est.why = compare(est, ranked[0])


def explain_single(est: Estimate) -> None:
    """why for an explicitly given layout: where its step time goes, or why it does not fit."""
    if not est.fits:
        est.why = "does not fit: " + memory_reason(est, est.memory_limit)
        return
    total = est.step_time_s
    parts = sorted(est.time_parts.items(), key=lambda kv: -kv[1])
    shown = ", ".join(f"{_PART_NAMES.get(k, k)} {v / total:.0%}" for k, v in parts if v >= 0.005 * total)
    est.why = (f"fits with {(est.memory_limit - est.memory.total) / GiB:.1f} GiB to spare; step time "
               f"({est.profile} profile): {shown}")


# ---------------------------------------------------------------------------- fits nowhere

def leanest_layout(cfg: Config, workload: Workload, hw: Hardware, runtime: Runtime,
                   gpus: int) -> tuple[Layout, float] | None:
    """The layout of `gpus` GPUs needing the least memory (zero=3, full recomputation, one
    sequence per micro-batch), with its worst-rank bytes; None if no layout is valid."""
    best = None
    for dp, tp, pp, cp, ep in degree_choices(cfg, workload, gpus, hw.gpus_per_node):
        layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, mbs=1, zero=3 if dp * cp > 1 else 0,
                        recompute="full", sp=tp > 1, cp_method=cfg.parallel.cp_method)
        if layout_problem(cfg, workload, layout, gpus, full_check=False):
            continue
        total = worst_rank_memory(workload, layout, hw, runtime).total
        if best is None or total < best[1]:
            best = (layout, total)
    return best


def smallest_fitting_cluster(cfg: Config, workload: Workload, hw: Hardware, runtime: Runtime,
                             start: int, limit: int = 1 << 20) -> tuple[int, Layout] | None:
    """The smallest GPU count (doubling from `start`) on which the leanest layout fits."""
    gpus = max(1, start)
    while gpus <= limit:
        lean = leanest_layout(cfg, workload, hw, runtime, gpus)
        if lean and lean[1] <= hw.memory_bytes:
            return gpus, lean[0]
        gpus *= 2
    return None
