"""The planner's price of Muon's optimizer step (plan/muon.py, issue 42 item 4): the matrices it
counts are the built model's, and the step time under train.optimizer = muon exceeds AdamW's by
the gathers and Newton–Schulz products the trainer runs, recomputed here from their definitions
(the trainer's bucket builder and Newton–Schulz flop count, the GEMM and ring formulas); the JSON
keeps the contract."""

from __future__ import annotations

import json

import pytest

from fivefold.configure import load_config
from fivefold.config.presets import PRESETS
from fivefold.plan.cli import run_plan
from fivefold.plan.estimate import estimate
from fivefold.plan.hardware import hardware_for
from fivefold.plan.speed.frameworks import runtime_for
from fivefold.plan.layout import Layout
from fivefold.plan.block_matrices import block_matrices
from fivefold.plan.muon import BUCKET_BYTES
from fivefold.plan.pipeline.schedule import pipeline_ranks
from fivefold.plan.workload import workload_from_config

NS_PRODUCTS = 5 * 3  # Newton–Schulz: 5 steps of three GEMMs (torch.optim._muon._zeropower_via_newtonschulz)


def _config(preset: str, optimizer: str, dtype: str = "fp32"):
    return load_config(None, ["--model.preset", preset, "--train.optimizer", optimizer, "--train.dtype", dtype,
                              "--train.seq_len", "4096", "--train.global_batch", "64"])


def _muon_matrices(cfg, named: bool = False):
    """(stack count, rows, cols) of each parameter the trainer's Muon updates, in parameter order:
    the blocks' matrices by kind (models/param_kinds.py), an expert stack's matrices together."""
    from fivefold.models import build_meta_model
    from fivefold.models.param_kinds import BLOCK_MATRIX_KINDS, param_kinds

    model = build_meta_model(cfg.model)
    kinds = param_kinds(model)
    return [(name,) * named + (p.shape[0] if p.dim() == 3 else 1, *p.shape[-2:])
            for name, p in model.named_parameters() if kinds[name] in BLOCK_MATRIX_KINDS and p.dim() >= 2]


@pytest.mark.parametrize("preset", sorted(p for p in PRESETS if p.startswith("tiny")) + ["deepseek-v2-lite"])
def test_the_planned_muon_matrices_are_the_built_models(preset):
    cfg = _config(preset, "muon")
    workload = workload_from_config(cfg)
    (rank,) = pipeline_ranks(workload.stats, Layout(), workload.seq_len)
    planned = [(f"layers.{layer}.{m.name}", m.count, *m.shape)
               for layer in rank.layers for m in block_matrices(workload.stats, layer, 1)]
    assert planned == _muon_matrices(cfg, named=True)  # the same in the same order (the order makes the buckets)


def test_the_bucket_size_is_the_trainers():
    from fivefold.parallel.data.buckets import BUCKET_BYTES as TRAINER

    assert BUCKET_BYTES == TRAINER


def _ns_seconds(shape, hw) -> float:
    """A matrix's Newton–Schulz on hw: its flops (the trainer's count) at the GEMM rate, plus one
    kernel fill per product; every product here is compute bound (checked)."""
    from fivefold.parallel.muon_matrices import ns_flops

    small, large = sorted(shape)
    rate = hw.peak_flops * hw.matmul_efficiency
    for m, n, k in ((small, small, large), (small, small, small), (small, large, small)):
        assert 2 * m * n * k / rate > (2 * (m * k + k * n) + 2 * m * n) / hw.hbm_bw
    return ns_flops(shape) / rate + NS_PRODUCTS * hw.gemm_fill_s


def _ring(nbytes: float, n: int, hw, efficiency: float = 1.0) -> float:
    """One ring all-gather or reduce-scatter of an nbytes buffer over n GPUs of one node."""
    return (n - 1) / n * nbytes / (hw.intra_bw * efficiency) + (n - 1) * hw.intra_latency_s


def _difference(preset: str, layout: Layout, dtype: str = "fp32"):
    hw, runtime = hardware_for("h100"), runtime_for()
    adamw, muon = (estimate(workload_from_config(_config(preset, opt, dtype)), layout, hw, runtime)
                   for opt in ("adamw", "muon"))
    return muon, adamw, hw, runtime


def test_zero1_pays_a_gather_and_scatter_per_bucket_and_the_slowest_owner_of_each_window():
    """llama3-8b at dp8·zero1 in bf16: the trainer's buckets (parallel/data/buckets.py on the
    model's Muon matrices), owners and windows (parallel/data/muon_step.py, as each of the 8 ranks
    builds them); windows of 8 buckets run one after another, each adding its slowest owner's
    Newton–Schulz."""
    import torch

    from fivefold.parallel.data.buckets import make_buckets
    from fivefold.parallel.data.muon_step import ChunkMatrices

    layout = Layout(dp=8, zero=1, mbs=1)
    muon, adamw, hw, runtime = _difference("llama3-8b", layout, "bf16")
    params = [torch.nn.Parameter(torch.empty(rows, cols, device="meta"))
              for _, rows, cols in _muon_matrices(_config("llama3-8b", "muon"))]
    buckets, chunks = make_buckets(params, padded_to=8), []
    owned = []  # per rank: id(chunk) -> the (start, end, shape) it orthogonalises
    for rank in range(8):
        for bucket in buckets:
            bucket.group, bucket.group_size, bucket.group_rank = object(), 8, rank
        chunks = [object() for _ in buckets]
        matrices = ChunkMatrices(buckets, chunks)
        owned.append([matrices.owned[id(c)] for c in chunks])
    expected = sent = 0.0
    assert matrices.window == 8
    for first in range(0, len(buckets), matrices.window):
        window = range(first, min(first + matrices.window, len(buckets)))
        expected += max(sum(_ns_seconds(shape, hw) for b in window for _, _, shape in owned[r][b]) for r in range(8))
    for bucket in buckets:
        gather = _ring(4 * bucket.numel, 8, hw, runtime.dp_bw_efficiency)  # the fp32 update
        expected += 2 * gather
        sent += 2 * 7 / 8 * 4 * bucket.numel
    assert muon.step_time_s - adamw.step_time_s == pytest.approx(expected, rel=1e-6)
    assert muon.comm_bytes["dp"] - adamw.comm_bytes["dp"] == pytest.approx(sent, rel=1e-6)
    assert muon.time_parts["newton_schulz"] + muon.time_parts["muon_gather"] == pytest.approx(expected, rel=1e-6)
    # which rank holds what: each data-parallel rank's Newton–Schulz flops, the run log's shares
    assert muon.muon["gflop_by_rank"]["dense"] == pytest.approx([f / 1e9 for f in matrices.shares], abs=1e-3)


def test_tp_gathers_each_tensor_and_all_reduces_it_back():
    """llama3-8b at tp2 (fp32): every Muon matrix is split by heads or hidden units; per tensor a
    gather over tp, the owner's Newton–Schulz, an all-reduce of the whole (two ring halves)."""
    muon, adamw, hw, _ = _difference("llama3-8b", Layout(tp=2, mbs=1))
    matrices = [(rows, cols) for _, rows, cols in _muon_matrices(_config("llama3-8b", "muon"))]
    expected = sum(_ring(4 * rows * cols, 2, hw) * 3 for rows, cols in matrices)
    from fivefold.parallel.muon_matrices import ns_flops

    # Owners as parallel/muon_dtensor.py picks them (largest first to the less loaded of the 2 tp
    # ranks), orthogonalised in windows of 2 consecutive tensors: each window costs its slower owner.
    flops = [ns_flops(shape) for shape in matrices]
    loads, owner = [0, 0], {}
    for i in sorted(range(len(matrices)), key=lambda i: (-flops[i], i)):
        owner[i] = loads.index(min(loads))
        loads[owner[i]] += flops[i]
    for first in range(0, len(matrices), 2):
        here = [0.0, 0.0]
        for i in range(first, min(first + 2, len(matrices))):
            here[owner[i]] += _ns_seconds(matrices[i], hw)
        expected += max(here)
    assert muon.step_time_s - adamw.step_time_s == pytest.approx(expected, rel=1e-6)


def test_whole_matrices_on_a_pipeline_stage_cost_only_their_products():
    muon, adamw, hw, _ = _difference("llama3-8b", Layout(pp=2, mbs=1))
    matrices = _muon_matrices(_config("llama3-8b", "muon"))
    per_layer = len(matrices) // 32  # identical layers: a stage's cost is its layer count's
    stats = workload_from_config(_config("llama3-8b", "muon")).stats
    stages = [len(r.layers) for r in pipeline_ranks(stats, Layout(pp=2), 4096)]
    expected = max(sum(_ns_seconds((rows, cols), hw) for _, rows, cols in matrices[:n * per_layer])
                   for n in stages)
    assert muon.step_time_s - adamw.step_time_s == pytest.approx(expected, rel=1e-6)
    assert muon.comm_bytes == adamw.comm_bytes  # nothing gathered


def test_muon_json_keeps_the_contract_and_says_where_the_work_goes(capsys):
    code = run_plan(["llama3-8b", "--train.optimizer", "muon", "--train.dtype", "bf16", "--train.seq_len", "4096",
                     "--train.global_batch", "64", "--cluster.gpu", "h100",
                     "--layout", "dp=8,zero=1,tp=1,pp=1,cp=1,mbs=1", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    (cand,) = json.loads(out.out)["candidates"]
    assert {"layout", "fits", "memory_bytes", "step_time_s", "tokens_per_sec_per_gpu", "mfu", "bubble_fraction",
            "comm_bytes", "why"} <= set(cand)
    assert set(cand["comm_bytes"]) == {"dp", "tp", "pp", "cp", "ep"}
    assert set(cand["memory_bytes"]) == {"params", "grads", "optimizer", "activations", "other", "total"}
    assert cand["time_parts_s"]["newton_schulz"] > 0 and cand["time_parts_s"]["muon_gather"] > 0
    assert "8 data-parallel ranks" in cand["muon"]["where"] and len(cand["muon"]["gflop_by_rank"]["dense"]) == 8
    assert "Newton–Schulz" in cand["why"]
