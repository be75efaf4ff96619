"""All five dimensions at once: layouts drawn from dp x zero x tp x pp (schedule) x cp (method) x ep,
dense and MoE, each against the single-process run (fp32 losses and gradient norms within 1e-5
relative per step, final weights), plus recomputation, bf16 and torch.compile inside 5D layouts.

The default suite runs the full 16-rank layouts (dp2 x tp2 x pp2 x cp2, and ep2 for MoE) in one
spawn, with recomputation and bf16; `pytest -m slow` adds torch.compile and the matrix: every value
of every dimension, each combined with the others (8-rank layouts that drop one dimension, and more
16-rank ones, ep8 borrowing tp ranks among them). The 16-rank spawn also checks that the
rank map (`fivefold layout`) is what the run really builds.
"""

import pytest

from layouts import (BASE, TP_WEIGHT_ATOL, assert_same_run, reference, run_layout, tiny_config, with_documents,
                     write_short_documents)
from ranks import run_on_ranks

# 4 layers so that pp2 with two virtual stages per rank (interleaved_1f1b, zbv) has a layer per stage.
DENSE = {"n_layers": 4}
# Dropless, bias balancing: what MoE supports with cp > 1 (capacity and the aux loss are per sequence).
MOE = {"n_layers": 4, "moe": {"n_experts": 4, "top_k": 2, "expert_ffn_dim": 64, "balance": "bias"}}
# 8 experts: ep8 over a stage's dp2·cp2·tp2 ranks, one expert each (ep > dp·cp: it borrows tp).
MOE8 = {**MOE, "moe": {**MOE["moe"], "n_experts": 8}}
# One sequence per micro-batch: dp2 gives 4 micro-batches per step, enough for every schedule at pp2.
# 4 steps (the other modules train 6): a step of 16 ranks on 2 cores costs ~2 s, and the matrix has
# 30 layouts; 4 steps still carry AdamW's state through three updates.
TRAIN = {"micro_batch": 1, "steps": 4}
# The other families (tests/test_families.py has each dimension alone): 4 layers of their tiny presets,
# at seed 5 (as there: seed 3 makes their step-4 gradient norm 300x more sensitive to summation order).
QWEN3 = {"preset": "tiny-qwen3", "n_layers": 4}
QWEN3_MOE = {"preset": "tiny-qwen3-moe", "n_layers": 4}
DEEPSEEK_V3 = {"preset": "tiny-deepseek-v3", "n_layers": 4, "n_kv_heads": 4}
# gpt-oss (tests/test_hf_gpt_oss.py has each dimension alone): layers 0 and 2 slide over 16 keys of
# the 32, so under cp2 the ring skips and trims blocks; sinks, biased attention and experts.
GPT_OSS = {"preset": "tiny-gpt-oss", "n_layers": 4}
# With tp, AdamW's m/sqrt(v) amplifies row-parallel reassociation on weights whose gradients nearly
# cancel (TP_WEIGHT_ATOL of tests/layouts.py; measured ~6e-5 on 8 layers); the same here.
SCHEDULE_VIRTUAL = {"1f1b": 1, "interleaved_1f1b": 2, "zbv": 2}


def layout(model: dict, dp=1, zero=0, tp=1, pp=1, schedule="1f1b", cp=1, method="ring", ep=1, dp_shard=0,
           **train) -> dict:
    parallel = {"dp": dp, "zero": zero, "tp": tp, "pp": pp, "pp_schedule": schedule,
                "pp_virtual": SCHEDULE_VIRTUAL[schedule], "cp": cp, "cp_method": method, "ep": ep,
                "dp_shard": dp_shard}
    return {"model": model, "parallel": parallel, "train": {**TRAIN, **train}}


def world(l: dict) -> int:
    p = l["parallel"]
    return p["dp"] * p["tp"] * p["pp"] * p["cp"]


def label(l: dict) -> str:
    p, t = l["parallel"], l["train"]
    kind = l["model"].get("preset", "moe" if "moe" in l["model"] else "dense")
    extra = "".join(f" {k}={v}" for k, v in t.items() if k != "micro_batch")
    hsdp = f"/shard{p['dp_shard']}" if p["dp_shard"] else ""
    return (f"{kind} dp{p['dp']}{hsdp} z{p['zero']} tp{p['tp']} pp{p['pp']}/{p['pp_schedule']} "
            f"cp{p['cp']}/{p['cp_method']} ep{p['ep']}{extra}")


# ---------------------------------------------------------------- the default subset: 16 ranks
FULL = [
    layout(DENSE, dp=2, zero=1, tp=2, pp=2, cp=2),
    layout(MOE, dp=2, zero=1, tp=2, pp=2, cp=2, ep=2),
    layout(MOE, dp=2, zero=0, tp=2, pp=2, schedule="interleaved_1f1b", cp=2, method="allgather", ep=2,
           recompute="selective"),
    layout(DENSE, dp=2, zero=3, tp=2, pp=2, schedule="interleaved_1f1b", cp=2, recompute="full"),
    layout(QWEN3, dp=2, zero=1, tp=2, pp=2, cp=2, method="ulysses", seed=5),
    layout(QWEN3_MOE, dp=2, zero=1, tp=2, pp=2, schedule="zbv", cp=2, ep=2, seed=5),
    layout(DEEPSEEK_V3, dp=2, zero=3, tp=2, pp=2, cp=2, method="allgather", ep=2),
    layout(GPT_OSS, dp=2, zero=1, tp=2, pp=2, schedule="zbv", cp=2, ep=2, seed=5),
]
# bf16 weights with fp32 masters (docs/precision.md): checked against the bf16 single process under
# the harness rule, and against fp32 within 2%. AdamW's eps 1e-4, the form that does not amplify
# bf16's rounding (as BASE's 1e-6 for fp32's: tests/layouts.py): its update g/(|g| + eps) moves by up
# to lr/eps per unit of gradient rounding, and bf16 gradients round 2^16 times coarser than fp32's.
# At 1e-6 the 5D run's step-3 gradient norm moved by 1.9e-3 and its weights by 1.1e-2 under
# ATEN_CPU_CAPABILITY=default; at 1e-4, 6.2e-4 and 2.4e-3.
BF16 = layout(MOE, dp=2, zero=1, tp=2, pp=2, schedule="zbv", cp=2, ep=2, dtype="bf16", adam_eps=1e-4)
COMPILED = layout(DENSE, dp=2, zero=1, tp=2, pp=2, cp=2, compile=True)
# Muon (docs/optimizers.md): each matrix gathered whole across ZeRO's chunks and tp's shards, the
# experts' under ep. One step, the check that catches a lost piece of a gathered matrix: the weights
# differ by 2.3e-4 against a bound of 1.2e-3, and by 2.5e-3 with one row of rank 0's tp shard lost.
# Later steps only amplify noise: Newton–Schulz in bf16 turns step 1's 2.3e-4 into a step-2
# gradient norm 4.8e-5 off, 10x the norm noise of the single process's own reassociation (whose
# step-1 weights differ as much: 3.1e-4). tests/test_muon_compositions.py trains two steps on 4 ranks.
MUON = layout(MOE, dp=2, zero=1, tp=2, pp=2, schedule="zbv", cp=2, ep=2, optimizer="muon", lr=0.02, steps=1)
# LoRA (docs/fine-tuning.md#lora): adapters beside attention, MLP and expert layers, the base frozen;
# tests/test_lora.py has each dimension alone. lr 1e-2: the adapters (B starts at zero) must move
# the run well beyond the bounds.
LORA = {**layout(MOE, dp=2, zero=1, tp=2, pp=2, schedule="zbv", cp=2, ep=2, lr=1e-2),
        "lora": {"rank": 4, "alpha": 8.0, "targets": "attention|mlp|experts"}}
# Document masking (data.document_mask, tests/test_document_mask.py) on a corpus of short documents:
# the ids reach every stage, and the ring masks blocks, under all five dimensions.
DOCUMENTS = layout(DENSE, dp=2, zero=1, tp=2, pp=2, cp=2)

# ---------------------------------------------------------------- the matrix (slow)
# Every value of every dimension appears, each with the others active: 16-rank layouts over the
# schedules, cp methods and ZeRO stages; 8-rank layouts with one dimension at 1 (and ep4).
SLOW_16 = [
    layout(DENSE, dp=2, zero=0, tp=2, pp=2, schedule="zbv", cp=2, method="allgather"),
    layout(DENSE, dp=2, zero=3, tp=2, pp=2, schedule="1f1b", cp=2, method="allgather"),
    layout(MOE, dp=2, zero=3, tp=2, pp=2, schedule="interleaved_1f1b", cp=2, ep=2),
    layout(MOE, dp=2, zero=1, tp=2, pp=2, schedule="zbv", cp=2, method="allgather", ep=2),
    layout(MOE, dp=2, zero=0, tp=2, pp=2, schedule="1f1b", cp=2, ep=4),
    # ep borrowing tp (mesh.py expert_groups): each tp rank dispatches its own slice of the tokens
    # to all 8 ranks of its stage; no two ranks hold the same expert (edp = dp·cp·tp/ep = 1). As
    # FULL[1] otherwise, so that a failure here is the borrowing's. (The default suite has ep
    # borrowing tp at 4 ranks, tests/test_expert_parallel.py; this one costs the 16-rank spawn ~1 min.)
    layout(MOE8, dp=2, zero=1, tp=2, pp=2, cp=2, ep=8),
]
SLOW_8 = [
    layout(DENSE, dp=2, zero=1, tp=2, pp=2, schedule="zbv"),
    layout(DENSE, dp=2, zero=3, tp=2, cp=2, method="allgather"),
    layout(DENSE, tp=2, pp=2, schedule="interleaved_1f1b", cp=2),
    layout(DENSE, dp=2, zero=0, pp=2, schedule="1f1b", cp=2, method="allgather"),
    layout(MOE, dp=2, zero=1, tp=2, pp=2, schedule="1f1b", ep=2),
    layout(MOE, dp=2, zero=3, tp=2, cp=2, ep=4),
    layout(MOE, dp=2, zero=0, pp=2, schedule="interleaved_1f1b", cp=2, method="allgather", ep=2),
    layout(MOE, tp=2, pp=2, schedule="zbv", cp=2, ep=2),
    # ep borrowing dp only, its edp group interleaving tp ranks ([0, 1, 4, 5]) under FSDP2.
    layout(MOE, dp=4, zero=3, tp=2, ep=2),
    # HSDP (dense weights sharded in pairs, the pairs replicated) composed with tp and cp; with pp below.
    layout(DENSE, dp=4, dp_shard=2, zero=3, tp=2),
    layout(DENSE, dp=4, dp_shard=2, zero=2, cp=2),
]
# torch.compile (aot_eager, as COMPILED) with recomputation inside the compiled blocks and with
# experts (routing, the bias update, the all-to-all dispatch traced), the second under HSDP with pp.
# expert_ffn_dim=60 keeps the per-expert loop in eager too (compiled fp32 experts always take it:
# torch 2.13's fake-tensor kernel of torch._grouped_mm accepts bf16 only; test_compiled_grouped_experts_fp32).
MOE_LOOPED = {**MOE, "moe": {**MOE["moe"], "expert_ffn_dim": 60}}
COMPILED_8 = [
    layout(MOE_LOOPED, dp=2, zero=1, tp=2, cp=2, ep=2, compile=True, recompute="selective"),
    layout(DENSE, dp=4, dp_shard=2, zero=3, pp=2, compile=True, recompute="full"),
]


# A 16-rank spawn's limits. A hang is caught by the collective that waits (10 minutes: one rank that
# far behind the others is stuck, even with 16 ranks on one core); the spawn's own limit is 3x what
# the slowest machine measured needs (the default spawn: 157 s on 2 cores, 477 s on one core shared
# with another suite, benchmarks/RESULTS.md), so a slow CPU does not fail it.
SIXTEEN_TIMEOUT_S, COLLECTIVE_TIMEOUT_S = 1800, 600


def what_rank_holds(l: dict) -> dict:
    """Train the layout and report what this rank really built: its groups and its layers/experts."""
    import torch.distributed as dist

    from fivefold.train.trainer import train

    result = train(tiny_config({**l, "train": {**l["train"], "steps": 1}}))  # the build is what counts
    par = result.parallel
    groups = {name: dist.get_process_group_ranks(par.mesh[name].get_group()) for name in ("tp", "cp", "pp", "dp")}
    if par.dims.ep > 1:
        groups["ep"] = dist.get_process_group_ranks(par.mesh["ep"].get_group())
    layers = sorted(int(i) for part in par.parts for i in part.layers.keys())
    experts = next(p for part in par.parts for n, p in part.named_parameters() if n.endswith("experts.w1"))
    # apply_expert_parallel keeps experts [ep_rank * n_local, (ep_rank + 1) * n_local).
    return {"groups": groups, "layers": layers, "n_local_experts": experts.shape[0],
            "ep_rank": par.mesh["ep"].get_local_rank()}


def _sixteen(layouts: list[dict]) -> tuple:
    return [run_layout(l) for l in layouts], what_rank_holds(FULL[1])


@pytest.fixture(scope="module")
def document_source(tmp_path_factory):
    return write_short_documents(tmp_path_factory.mktemp("documents") / "short.jsonl")


@pytest.fixture(scope="module")
def sixteen_rank_results(document_source):
    # 16 ranks on a 2-core machine: several minutes; the timeout only guards against a hang.
    # (The matrix's 16 ranks are a spawn of their own: each spawn well inside its timeout on a slow machine.)
    return run_on_ranks(16, _sixteen, [*FULL, BF16, with_documents(DOCUMENTS, document_source), MUON, LORA],
                        timeout_s=SIXTEEN_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S)


def weight_atol(l: dict) -> float:
    return TP_WEIGHT_ATOL if l["parallel"]["tp"] > 1 else 1e-5


def check(results, index: int, l: dict) -> None:
    want = reference(l)
    for rank, runs in enumerate(results):
        assert_same_run(runs[index], want, weight_atol=weight_atol(l), label=f"{label(l)} rank {rank}")


@pytest.mark.parametrize("index", range(len(FULL)), ids=[label(l) for l in FULL])
def test_full_5d(sixteen_rank_results, index):
    check([runs for runs, _ in sixteen_rank_results], index, FULL[index])


def test_bf16_5d(sixteen_rank_results):
    """Equal to the bf16 single process (harness rule), and within 2% of fp32's: it really ran bf16.

    The experts' weights are apart: the router's logits are a bf16 matmul of hidden states that tp
    and cp round differently, so now and then a token's top-2 flips, and the two experts it leaves
    and joins get another gradient. AdamW moves an element by at most ~lr a step whatever its
    gradient, so they stay within 2 lr per step (seen: 1.1e-2 after 4 steps at lr 3e-3 and eps 1e-6,
    2.4e-3 at eps 1e-4, against 2.4e-2). What a flip cannot move is checked as every layout is:
    losses, norms and every other weight under the harness rule."""
    from dataclasses import replace

    def without_experts(run):
        return replace(run, weights={n: t for n, t in run.weights.items() if ".experts." not in n})

    want = reference(BF16)
    flip_bound = 2 * BF16["train"].get("lr", BASE["train"]["lr"]) * BF16["train"]["steps"]
    for rank, (runs, _) in enumerate(sixteen_rank_results):
        got = runs[len(FULL)]
        assert_same_run(without_experts(got), without_experts(want), weight_atol=weight_atol(BF16),
                        label=f"{label(BF16)} rank {rank}")
        experts = {n: t for n, t in got.weights.items() if ".experts." in n}
        assert experts, "the bf16 5D layout is an MoE"
        for name, tensor in experts.items():
            diff = (tensor - want.weights[name]).abs().max().item()
            assert diff <= flip_bound, f"rank {rank}: {name} differs by {diff} (routing-flip bound {flip_bound:.1e})"
    fp32 = reference({**BF16, "train": {k: v for k, v in BF16["train"].items() if k != "dtype"}})
    got = sixteen_rank_results[0][0][len(FULL)]
    for step, (a, b) in enumerate(zip(got.losses, fp32.losses), 1):
        assert abs(a - b) <= 0.02 * b, f"step {step}: bf16 {a} vs fp32 {b}"
    assert got.losses != fp32.losses


def test_document_mask_5d(sixteen_rank_results, document_source):
    check([runs for runs, _ in sixteen_rank_results], len(FULL) + 1, with_documents(DOCUMENTS, document_source))


def test_muon_5d(sixteen_rank_results):
    check([runs for runs, _ in sixteen_rank_results], len(FULL) + 2, MUON)


def test_lora_5d(sixteen_rank_results):
    """Equal to the single-process LoRA run, and the frozen base bit for bit as it started."""
    import torch

    from test_lora import _initial

    check([runs for runs, _ in sixteen_rank_results], len(FULL) + 3, LORA)
    initial = _initial(LORA)
    for rank, (runs, _) in enumerate(sixteen_rank_results):
        for name, value in initial.items():
            assert torch.equal(runs[len(FULL) + 3].weights[name], value), f"rank {rank}: {name} moved"


def test_rank_map_is_what_the_run_builds(sixteen_rank_results):
    from fivefold.mesh import ParallelDims
    from fivefold.tools.rank_map import rank_groups, rank_infos

    cfg = tiny_config(FULL[1])
    dims = ParallelDims.from_config(cfg.parallel)
    predicted, infos = rank_groups(dims), rank_infos(cfg, dims)
    for rank, (_, held) in enumerate(sixteen_rank_results):
        for name, ranks in held["groups"].items():
            assert ranks in predicted[name], f"rank {rank}: {name} group {ranks} not in the map"
        assert held["layers"] == infos[rank].layers, f"rank {rank}"
        first, last = infos[rank].experts
        n_local = held["n_local_experts"]
        assert (held["ep_rank"] * n_local, (held["ep_rank"] + 1) * n_local) == (first, last), f"rank {rank}"


# ---------------------------------------------------------------- slow: the matrix
@pytest.fixture(scope="module")
def slow_sixteen():
    return run_on_ranks(16, run_all, [*SLOW_16, COMPILED], timeout_s=SIXTEEN_TIMEOUT_S,
                        collective_timeout_s=COLLECTIVE_TIMEOUT_S)


@pytest.fixture(scope="module")
def slow_eight():
    return run_on_ranks(8, run_all, [*SLOW_8, *COMPILED_8])


def run_all(layouts: list[dict]) -> list:  # module level: sent to ranks by reference
    use_aot_eager_compile()
    return [run_layout(l) for l in layouts]


def use_aot_eager_compile() -> None:
    """torch.compile with the aot_eager backend in this process. What composing compile with the five
    dimensions can break is Dynamo tracing the blocks (DTensor, ring attention, expert dispatch,
    hooks) and AOT autograd; Inductor's C++ code generation is per kernel and the same in any layout,
    and costs ~160 s per process on 2 cores (16 ranks: far beyond the CI budget)."""
    import functools

    import torch

    if not isinstance(torch.compile, functools.partial):
        torch.compile = functools.partial(torch.compile, backend="aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SLOW_16)), ids=[label(l) for l in SLOW_16])
def test_matrix_16_ranks(slow_sixteen, index):
    check(slow_sixteen, index, SLOW_16[index])


@pytest.mark.slow
def test_compiled_5d(slow_sixteen, monkeypatch):
    import functools

    import torch

    # The reference compiles the same way (only for this test: monkeypatch undoes it).
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    check(slow_sixteen, len(SLOW_16), COMPILED)
    assert all(runs[len(SLOW_16)].compile_s > 0 for runs in slow_sixteen)  # really compiled on every rank


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SLOW_8)), ids=[label(l) for l in SLOW_8])
def test_matrix_8_ranks(slow_eight, index):
    check(slow_eight, index, SLOW_8[index])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(COMPILED_8)), ids=[label(l) for l in COMPILED_8])
def test_compiled_8_ranks(slow_eight, index, monkeypatch):
    import functools

    import torch

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    check(slow_eight, len(SLOW_8) + index, COMPILED_8[index])
    assert all(runs[len(SLOW_8) + index].compile_s > 0 for runs in slow_eight)  # really compiled on every rank


def test_compiled_grouped_experts_fp32(monkeypatch):
    """torch 2.13's fake-tensor kernel of torch._grouped_mm accepts bf16 only: compiled fp32 experts
    trace the per-expert loop instead (models/moe/layer.py grouped_mm_usable) and train like eager."""
    import functools

    import torch

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    settings = {"model": MOE, "train": {**TRAIN, "steps": 2}}  # expert_ffn_dim 64: the grouped matmul
    compiled = run_layout({**settings, "train": {**settings["train"], "compile": True}})
    assert_same_run(compiled, reference(settings), label="compiled fp32 grouped experts")


def test_matrix_covers_every_value():
    """The layouts tested, default and slow together, use every value the issue names."""
    every = [*FULL, BF16, COMPILED, *SLOW_16, *SLOW_8, *COMPILED_8]
    seen = {key: {l["parallel"][key] for l in every} for key in ("dp", "zero", "tp", "pp", "cp", "ep")}
    assert seen == {"dp": {1, 2, 4}, "zero": {0, 1, 2, 3}, "tp": {1, 2}, "pp": {1, 2}, "cp": {1, 2}, "ep": {1, 2, 4, 8}}
    hsdp = [l["parallel"] for l in every if 0 < l["parallel"]["dp_shard"] < l["parallel"]["dp"]]
    assert all(any(p[key] > 1 for p in hsdp) for key in ("tp", "cp", "pp")), "HSDP with each of tp, cp, pp"
    compiled = [l for l in every if l["train"].get("compile")]
    assert {l["train"].get("recompute", "none") for l in compiled} == {"none", "selective", "full"}
    assert any("moe" in l["model"] and l["parallel"]["ep"] > 1 for l in compiled)
    assert {l["parallel"]["pp_schedule"] for l in every if l["parallel"]["pp"] > 1} == set(SCHEDULE_VIRTUAL)
    assert {l["parallel"]["cp_method"] for l in every if l["parallel"]["cp"] > 1} == {"ring", "allgather", "ulysses"}
    assert all(len(l) == 3 and world(l) in (8, 16) for l in every)
