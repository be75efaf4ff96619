"""Issue 9's check of activation memory against our own runs: the planner's predicted
activation bytes per rank ('fivefold' recipe, plan/memory/activations.py) within 10% of what one
micro-batch's forward really keeps for backward (train/activation_probe.py), for fp32 and bf16
autocast, tensor (with and without sequence), context and expert parallelism, dense and MoE
blocks, and each recomputation mode; for the llama-style tiny model and (issue 17) the tiny
qwen3 and qwen3_moe presets, whose per-head q/k norms and queries wider than the residual stream
(head_dim 48 x 4 heads = 192 > dim 128) the recipe must count; (issue 18) tiny-deepseek-v3, whose
latent attention keeps its latents and their norms whole over tp and on the gathered sequence,
q/k of 16+8 per head and v of 16 (which sends CPU attention down SDPA's math path: fp32 scores).

A sequence of 256 tokens makes activations dominate the small fixed tensors."""

import pytest
import torch

from fivefold.config.presets import PRESETS
from layouts import BASE, tiny_config
from ranks import run_on_ranks

SHAPE = {"train": {"seq_len": 256, "micro_batch": 2, "global_batch": 2}}


def _with(parallel: dict, **train) -> dict:
    return {"parallel": parallel, "train": {**SHAPE["train"], **train}}


def _preset(name: str) -> dict:
    """A preset whole: the BASE shape tiny_config starts from would override its own."""
    return {"model": {"preset": name, **{key: PRESETS[name][key] for key in BASE["model"]}}}


MOE = {"model": {"moe": {"n_experts": 4, "top_k": 2, "expert_ffn_dim": 64}}}
QWEN3 = {"qwen3": _preset("tiny-qwen3"), "qwen3-moe": _preset("tiny-qwen3-moe")}
FAMILIES = {**QWEN3, "deepseek-v3": _preset("tiny-deepseek-v3")}
ONE_RANK = {f"{dtype} {mode}": _with({}, recompute=mode, dtype=dtype)
            for dtype in ("fp32", "bf16") for mode in ("none", "selective", "full")}
ONE_RANK.update({f"moe {dtype} {mode}": {**MOE, **_with({}, recompute=mode, dtype=dtype)}
                 for dtype in ("fp32", "bf16") for mode in ("none", "selective")})
# The two-rank layouts every model is measured under (the MoE ones add their own below).
LAYOUTS_2 = {
    **{f"tp2 {mode}": _with({"tp": 2}, recompute=mode) for mode in ("none", "selective", "full")},
    "tp2 no-sp none": _with({"tp": 2, "sp": False}),
    "tp2 bf16 none": _with({"tp": 2}, dtype="bf16"),
    "tp2 bf16 selective": _with({"tp": 2}, dtype="bf16", recompute="selective"),
    "cp2 ring": _with({"cp": 2}),
    "cp2 ulysses": _with({"cp": 2, "cp_method": "ulysses"}),
    "cp2 ring selective": _with({"cp": 2}, recompute="selective"),
}
TWO_RANKS = {
    **LAYOUTS_2,
    "moe dp2 ep2": {**MOE, **_with({"dp": 2, "ep": 2}, global_batch=4)},
    "moe tp2": {**MOE, **_with({"tp": 2})},
    # The gathered inputs kept whole (parallel.sp_keep_gathered) rather than their shards.
    "tp2 keep-gathered none": _with({"tp": 2, "sp_keep_gathered": True}),
}
for family, model in FAMILIES.items():
    ONE_RANK.update({f"{family} {dtype} {mode}": {**model, **_with({}, recompute=mode, dtype=dtype)}
                     for dtype in ("fp32", "bf16") for mode in ("none", "selective", "full")})
    TWO_RANKS.update({f"{family} {label}": {**model, **layout} for label, layout in LAYOUTS_2.items()})
for family in ("qwen3-moe", "deepseek-v3"):
    TWO_RANKS[f"{family} dp2 ep2"] = {**FAMILIES[family], **_with({"dp": 2, "ep": 2}, global_batch=4)}
# Two-matrix MLPs (model.mlp_activation, issue 41): up's output and the activation's, not SwiGLU's three.
for act in ("gelu", "relu2"):
    ONE_RANK.update({f"{act} {dtype} {mode}": {"model": {"mlp_activation": act}, **_with({}, recompute=mode, dtype=dtype)}
                     for dtype in ("fp32", "bf16") for mode in ("none", "selective")})
    TWO_RANKS.update({f"{act} tp2 {mode}": {"model": {"mlp_activation": act}, **_with({"tp": 2}, recompute=mode)}
                      for mode in ("none", "selective")})

# At tp4 selective recomputation checkpoints each residual branch apart and keeps the output
# projections' inputs instead of their whole outputs (plan/memory/branch_split.py; at tp2 these shapes
# keep the outputs): test_branches_apart_keep_less checks that this is what the measurement sees.
FOUR_KV = {"model": {"n_kv_heads": 4}}
FOUR_RANKS = {
    "tp4 selective": {**FOUR_KV, **_with({"tp": 4}, recompute="selective")},
    "tp4 bf16 selective": {**FOUR_KV, **_with({"tp": 4}, recompute="selective", dtype="bf16")},
    "moe tp4 selective": {"model": {**MOE["model"], "n_kv_heads": 4}, **_with({"tp": 4}, recompute="selective")},
    "qwen3 tp4 selective": {"model": {**QWEN3["qwen3"]["model"], "n_kv_heads": 4},
                            **_with({"tp": 4}, recompute="selective")},
    "tp4 none": {**FOUR_KV, **_with({"tp": 4})},
}

# The same cases with wider heads (head_dim 64: q 256, kv 128): what the q-width terms add is a few
# percent of the whole, so test_q_width_terms compares the change with the predicted change.
WIDER = {"qwen3 fp32 none": ONE_RANK, "qwen3 bf16 selective": ONE_RANK, "qwen3 cp2 ring": TWO_RANKS}
for label, cases in WIDER.items():
    case = cases[label]
    cases[f"{label} head_dim 64"] = {**case, "model": {**case["model"], "head_dim": 64}}

# And tiny-deepseek-v3 with one MLA width changed at a time: test_mla_width_terms.
MLA_WIDER = {"latents 64": {"q_lora_rank": 64, "kv_lora_rank": 64}, "v_head_dim 32": {"v_head_dim": 32},
             "rope 16": {"qk_rope_head_dim": 16}}
MLA_CASES = {"deepseek-v3 fp32 none": ONE_RANK, "deepseek-v3 bf16 none": ONE_RANK,
             "deepseek-v3 bf16 selective": ONE_RANK, "deepseek-v3 tp2 none": TWO_RANKS,
             "deepseek-v3 tp2 selective": TWO_RANKS}
for label, cases in MLA_CASES.items():
    case = cases[label]
    for change, keys in MLA_WIDER.items():
        cases[f"{label} {change}"] = {**case, "model": {**case["model"], **keys}}


def _measure(layouts: dict) -> dict:
    from fivefold.train.activation_probe import forward_kept_bytes
    from fivefold.train.trainer import autocast, setup

    out = {}
    for label, overrides in layouts.items():
        cfg = tiny_config(overrides)
        rt, par = setup(cfg)
        batch = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.train.seq_len + 1),
                              generator=torch.Generator().manual_seed(0))
        out[label] = forward_kept_bytes(par, batch, lambda: autocast(cfg, rt.device))
    return out


def _predicted(overrides: dict) -> float:
    from fivefold.plan import plan_layout
    from fivefold.plan.layout import layout_from_config

    cfg = tiny_config(overrides)
    return plan_layout(cfg, layout_from_config(cfg), gpu="cpu").memory.activations


@pytest.fixture(scope="module")
def measured():
    one = _measure(ONE_RANK)
    per_rank = run_on_ranks(2, _measure, TWO_RANKS)
    two = {label: max(rank[label] for rank in per_rank) for label in TWO_RANKS}  # the worst rank
    per_rank = run_on_ranks(4, _measure, FOUR_RANKS)
    four = {label: max(rank[label] for rank in per_rank) for label in FOUR_RANKS}
    return {**one, **two, **four}


@pytest.mark.parametrize("label", [*ONE_RANK, *TWO_RANKS, *FOUR_RANKS])
def test_predicted_activations_match_what_the_forward_keeps(measured, label):
    want = measured[label]
    got = _predicted({**ONE_RANK, **TWO_RANKS, **FOUR_RANKS}[label])
    assert abs(got - want) <= 0.10 * want, f"{label}: predicted {got:,.0f} B, measured {want:,} B"


@pytest.mark.parametrize("label", [label for label in FOUR_RANKS if "selective" in label])
def test_branches_apart_keep_less(measured, label, monkeypatch):
    """The run at tp4 keeps what the branches-apart recipe predicts, not what blocks checkpointed
    whole would (the projections' outputs): the measurement is nearer the first."""
    import fivefold.plan.memory.activations as activations

    apart = _predicted(FOUR_RANKS[label])
    monkeypatch.setattr(activations, "split_branches", lambda *args: False)
    activations.clear_caches()  # memoised per layout; the recipe changed under it
    whole = _predicted(FOUR_RANKS[label])
    activations.clear_caches()
    assert apart < whole and measured[label] < (apart + whole) / 2, \
        f"{label}: measured {measured[label]:,} B, predicted {apart:,.0f} B apart, {whole:,.0f} B whole"


def test_sharded_inputs_keep_less(measured):
    """Without recomputation the column-parallel layers keep their input's shard (the default) or
    the gathered input (sp_keep_gathered): the measurement tells them apart by what the recipe
    says they differ by (parallel/tensor/sharded_inputs.py)."""
    for label in ("tp2 none", "tp4 none"):
        cases = {**TWO_RANKS, **FOUR_RANKS}
        kept = _predicted({**cases[label], "parallel": {**cases[label]["parallel"], "sp_keep_gathered": True}})
        sharded = _predicted(cases[label])
        assert sharded < kept and measured[label] < (sharded + kept) / 2, (label, measured[label], sharded, kept)
    assert measured["tp2 none"] < measured["tp2 keep-gathered none"]


def test_compiled_blocks_are_planned_keeping_the_gathered_inputs():
    """Compiled blocks do not save shards (the partitioner decides what is kept): the planner counts
    the gathered inputs for them, as for sp_keep_gathered, and no backward re-gather."""
    from fivefold.plan import plan_layout
    from fivefold.plan.layout import layout_from_config

    def planned(parallel: dict, compile: str):
        cfg = tiny_config(_with({"tp": 2, **parallel}, compile=compile))
        return plan_layout(cfg, layout_from_config(cfg), gpu="cpu")

    compiled, kept, sharded = planned({}, "true"), planned({"sp_keep_gathered": True}, "false"), planned({}, "false")
    assert compiled.memory.activations == kept.memory.activations > sharded.memory.activations
    assert compiled.comm_bytes["tp"] == kept.comm_bytes["tp"] < sharded.comm_bytes["tp"]


def test_measurement_sees_recomputation(measured):
    # The probe is a measurement, not the formula: each mode keeps strictly less.
    for model in ("", "qwen3 ", "qwen3-moe ", "deepseek-v3 "):
        for dtype in ("fp32", "bf16"):
            assert (measured[f"{model}{dtype} none"] > measured[f"{model}{dtype} selective"]
                    > measured[f"{model}{dtype} full"])
        assert measured[f"{model}tp2 none"] < measured[f"{model}tp2 no-sp none"]  # sp splits the norms


def test_qwen3_cases_have_queries_wider_than_the_stream():
    # What makes them worth measuring: a recipe that took q = dim would be off by 20% and more.
    for model in QWEN3.values():
        m = tiny_config(model).model
        assert m.n_heads * m.head_dim > m.dim and m.family.startswith("qwen3")


@pytest.mark.parametrize("label", WIDER)
def test_q_width_terms(measured, label):
    """From head_dim 48 to 64 every query-wide tensor (q, the attention output, its copy under cp,
    the q/k norms' input and x·rstd) grows: the bytes added match the recipe's."""
    cases = {**ONE_RANK, **TWO_RANKS}
    wider = f"{label} head_dim 64"
    want = measured[wider] - measured[label]
    got = _predicted(cases[wider]) - _predicted(cases[label])
    assert want > 0 and abs(got - want) <= 0.10 * want, \
        f"{label}: predicted +{got:,.0f} B, measured +{want:,} B"


@pytest.mark.parametrize("change", MLA_WIDER)
@pytest.mark.parametrize("label", MLA_CASES)
def test_mla_width_terms(measured, label, change):
    """Wider latents (each latent norm's fp32 input, x·rstd and output; under selective the
    down-projections' outputs; the same on every tp rank: they run whole, on the gathered
    sequence), a wider v (its fp32 copy on SDPA's math path, the output's copy; kv_b's output
    under selective), more RoPE channels (q and k; under selective in q_b's output and once in
    kv_a's, not per head): the bytes added match the recipe's."""
    cases = {**ONE_RANK, **TWO_RANKS}
    wider = f"{label} {change}"
    want = measured[wider] - measured[label]
    got = _predicted(cases[wider]) - _predicted(cases[label])
    assert want > 0 and abs(got - want) <= 0.10 * want, \
        f"{wider}: predicted +{got:,.0f} B, measured +{want:,} B"


# ------------------------------------------------------------------------------- pipelines (issue 20)
# What a pipeline rank holds at its peak: the in-flight micro-batches of each of its stages
# (train/pipeline_probe.py measures one real step of the schedule), against the planner's count per
# schedule and per rank (plan/pipeline/schedule.py in_flight_per_chunk). Eight micro-batches of one
# sequence; four layers at pp2 and eight at pp4, so that every stage of a two-chunk schedule
# (interleaved, V) holds one layer or more.

def _pipeline(schedule: str, pp: int, **train) -> dict:
    virtual = 1 if schedule in ("1f1b", "gpipe") else 2
    return {"model": {"n_layers": 4 * pp // 2},
            "parallel": {"pp": pp, "pp_schedule": schedule, "pp_virtual": virtual},
            "train": {**SHAPE["train"], "micro_batch": 1, "global_batch": 8, **train}}


PIPELINES_2 = {
    "pp2 1f1b": _pipeline("1f1b", 2),
    "pp2 interleaved_1f1b": _pipeline("interleaved_1f1b", 2),
    "pp2 zbv": _pipeline("zbv", 2),
    "pp2 dualpipev bf16": _pipeline("dualpipev", 2, dtype="bf16"),
    "pp2 zb full": _pipeline("zb", 2, recompute="full"),
}
PIPELINES_4 = {
    "pp4 1f1b": _pipeline("1f1b", 4),
    "pp4 interleaved_1f1b": _pipeline("interleaved_1f1b", 4),
    "pp4 zbv": _pipeline("zbv", 4),
}


def _measure_pipelines(layouts: dict) -> dict:
    """label -> (this rank's pipeline rank, its measured peak bytes)."""
    from fivefold.config import micro_batches
    from fivefold.train.pipeline_probe import pipeline_peak_bytes
    from fivefold.train.trainer import autocast, setup

    out = {}
    for label, overrides in layouts.items():
        cfg = tiny_config(overrides)
        rt, par = setup(cfg)
        batch = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.train.seq_len + 1),
                              generator=torch.Generator().manual_seed(0))
        peak, _ = pipeline_peak_bytes(par, batch, micro_batches(cfg), lambda: autocast(cfg, rt.device))
        out[label] = (par.pipeline.pp_rank, peak)
    return out


def _predicted_per_rank(overrides: dict) -> list[float]:
    from fivefold.plan import DEFAULT_RUNTIME, hardware_for
    from fivefold.plan.layout import layout_from_config
    from fivefold.plan.memory.peak import rank_memory
    from fivefold.plan.pipeline.schedule import pipeline_ranks
    from fivefold.plan.workload import workload_from_config

    cfg = tiny_config(overrides)
    workload, layout, hw = workload_from_config(cfg), layout_from_config(cfg), hardware_for("cpu", 8)
    return [rank_memory(workload, layout, hw, DEFAULT_RUNTIME, prank, r).activations
            for r, prank in enumerate(pipeline_ranks(workload.stats, layout, workload.seq_len))]


@pytest.fixture(scope="module")
def pipeline_measured():
    out = {}
    for world, layouts in ((2, PIPELINES_2), (4, PIPELINES_4)):
        for per_rank in run_on_ranks(world, _measure_pipelines, layouts):
            for label, (pp_rank, peak) in per_rank.items():
                out.setdefault(label, {})[pp_rank] = peak
    return out


@pytest.mark.parametrize("label", [*PIPELINES_2, *PIPELINES_4])
def test_pipeline_ranks_hold_what_the_planner_predicts(pipeline_measured, label):
    """Every pipeline rank's peak of saved activations during a real step, within 10% of the
    planner's `rank_memory(...).activations` for that rank (first ranks hold the most stages'
    micro-batches, V schedules spread them, the last holds the loss's log-softmax)."""
    want = pipeline_measured[label]
    got = _predicted_per_rank({**PIPELINES_2, **PIPELINES_4}[label])
    assert sorted(want) == list(range(len(got)))
    for rank, measured in want.items():
        assert abs(got[rank] - measured) <= 0.10 * measured, \
            f"{label} rank {rank}: predicted {got[rank]:,.0f} B, measured {measured:,} B"


# dualpipev needs at least as many micro-batches as stages (2·pp): no (4, 4) case for it.
@pytest.mark.parametrize("schedule, pp, n_micro", [
    (schedule, pp, n_micro) for schedule in ("gpipe", "interleaved_1f1b", "zb", "zbv", "dualpipev")
    for pp, n_micro in ((2, 4), (2, 6), (4, 4), (4, 8), (4, 12)) if schedule != "dualpipev" or n_micro >= 2 * pp])
def test_in_flight_counts_follow_the_schedules_tables(schedule, pp, n_micro):
    """The planner's closed forms give, per rank and chunk, the micro-batches in flight at the
    rank's peak in the schedule's own action table (parallel/pipeline/schedule_table.py): a forward holds
    until its full backward, or until the weight pass of a split one (the input pass keeps the
    graph). Schedule1F1B runs its own loop (p - rank warm-up forwards), not its printed table."""
    from fivefold.plan.pipeline.stage_split import stages_of_rank
    from fivefold.parallel.pipeline.schedule_table import action_table
    from fivefold.plan.layout import Layout
    from fivefold.plan.pipeline.schedule import in_flight_per_chunk

    virtual = 1 if schedule == "gpipe" else 2
    layout = Layout(pp=pp, pp_schedule=schedule, pp_virtual=virtual)
    for rank, entries in action_table(schedule, pp, virtual, n_micro).items():
        live: set[tuple[int, int]] = set()
        peak: tuple[int, ...] = ()
        stages = stages_of_rank(rank, pp, virtual, schedule)
        for entry in entries:
            for action in entry:
                key = (action.stage, action.micro_batch)
                if action.kind == "F":
                    live.add(key)
                elif action.kind in ("B", "W"):
                    live.discard(key)
                if len(live) > sum(peak):
                    peak = tuple(sum(1 for s, _ in live if s == stage) for stage in stages)
        assert in_flight_per_chunk(layout, rank, n_micro) == peak, f"rank {rank}"
