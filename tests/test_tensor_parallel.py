"""Tensor (+ sequence) parallelism alone and with data parallelism, and HSDP (also with experts),
against the single-process run."""

import pytest

import torch

from layouts import assert_same_run, reference, run_layouts, tiny_config
from ranks import run_on_ranks

MOE = {"moe": {"n_experts": 4, "top_k": 2, "expert_ffn_dim": 64, "balance": "bias"}}
TP2_LAYOUTS = [
    {"parallel": {"tp": 2, "sp": True}},
    {"parallel": {"tp": 2, "sp": False}},
    {"parallel": {"tp": 2}, "train": {"micro_batch": 2}},
    {"parallel": {"tp": 2}, "train": {"eval_every": 3, "eval_batches": 2}},  # held-out loss (Run.eval_losses)
    # The gathered inputs kept for backward instead of their shards (parallel/tensor/sharded_inputs.py).
    {"parallel": {"tp": 2, "sp_keep_gathered": True}},
]
# Inductor blocks under tp2 + sp (the tp collectives outside the graphs): against the eager single
# process, as tests/test_data_parallel.py's dp2. Compiled blocks keep the gathered inputs (no
# backward re-gather), so the ledger sees the sp_keep_gathered layout's traffic.
INDUCTOR_TP2 = {"parallel": {"tp": 2, "sp": True}, "train": {"compile": True}}
KEEP_GATHERED = 4  # TP2_LAYOUTS' index of the sp_keep_gathered layout
FOUR_RANK_LAYOUTS = [
    {"parallel": {"tp": 4}, "model": {"n_kv_heads": 4}},  # tp must divide the kv heads
    # Selective recomputation at tp4 checkpoints each residual branch apart and keeps the output
    # projections' inputs (plan/memory/branch_split.py; the single process checkpoints blocks whole).
    {"parallel": {"tp": 4}, "model": {"n_kv_heads": 4}, "train": {"recompute": "selective"}},
    {"parallel": {"tp": 4}, "model": {"n_kv_heads": 4, **MOE}, "train": {"recompute": "selective"}},
    {"parallel": {"dp": 2, "tp": 2, "zero": 1}},
    {"parallel": {"dp": 2, "tp": 2, "zero": 3}},
    {"parallel": {"dp": 2, "tp": 2, "zero": 1}, "train": {"micro_batch": 1}},
    {"parallel": {"dp": 2, "tp": 2, "zero": 3}, "train": {"micro_batch": 1}},
    {"parallel": {"dp": 4, "zero": 3, "dp_shard": 2}},
    {"parallel": {"dp": 4, "zero": 1, "dp_shard": 2}},
    {"parallel": {"dp": 4, "zero": 2, "dp_shard": 2}},
    # HSDP with experts: dense weights sharded in pairs and replicated, experts sharded (ZeRO) over
    # their whole expert-data-parallel group, replicas included.
    {"parallel": {"dp": 4, "zero": 1, "dp_shard": 2, "ep": 2}, "model": MOE},
    {"parallel": {"dp": 4, "zero": 2, "dp_shard": 2, "ep": 2}, "model": MOE},
    {"parallel": {"dp": 4, "zero": 3, "dp_shard": 2, "ep": 2}, "model": MOE},
    {"parallel": {"dp": 4, "zero": 3, "dp_shard": 2, "ep": 4}, "model": MOE},
]
BF16 = {"parallel": {"dp": 2, "tp": 2, "zero": 1}, "train": {"dtype": "bf16"}}


@pytest.fixture(scope="module")
def tp2_results():
    return run_on_ranks(2, run_layouts, [*TP2_LAYOUTS, INDUCTOR_TP2])


@pytest.fixture(scope="module")
def four_rank_results():
    return run_on_ranks(4, run_layouts, FOUR_RANK_LAYOUTS + [BF16])


@pytest.mark.parametrize("index", range(len(TP2_LAYOUTS)))
def test_tp2(tp2_results, index):
    layout = TP2_LAYOUTS[index]
    want = reference(layout)
    for rank, results in enumerate(tp2_results):
        assert_same_run(results[index], want, label=f"{layout} rank {rank}")


@pytest.mark.parametrize("index", range(len(FOUR_RANK_LAYOUTS)))  # bf16 (last) is checked apart
def test_four_ranks(four_rank_results, index):
    layout = FOUR_RANK_LAYOUTS[index]
    want = reference(layout)
    for rank, results in enumerate(four_rank_results):
        assert_same_run(results[index], want, label=f"{layout} rank {rank}")


def test_inductor_compiled_tp2_matches_the_eager_single_process(tp2_results):
    assert TP2_LAYOUTS[KEEP_GATHERED]["parallel"].get("sp_keep_gathered")
    want = reference({"parallel": INDUCTOR_TP2["parallel"]})  # eager: train.compile left out
    for rank, results in enumerate(tp2_results):
        got = results[len(TP2_LAYOUTS)]
        assert_same_run(got, want, label=f"Inductor tp2 rank {rank}")
        assert got.compile_s > 0 and want.compile_s == 0  # the blocks really ran compiled
        assert got.comm == results[KEEP_GATHERED].comm != results[0].comm


def test_tp_shards_differ_across_ranks(tp2_results):
    """Each tp rank holds a different slice of a split weight (a copied-seed bug would make them equal)."""
    first, second = tp2_results[0][0].local_wq, tp2_results[1][0].local_wq
    assert first.shape == second.shape
    assert not torch.allclose(first, second)
    full = reference(TP2_LAYOUTS[0]).weights["layers.0.attention.wq.weight"]
    assert torch.allclose(torch.cat([first, second]), full, atol=1e-5)


def test_tp_ledger_matches_megatron_volume(tp2_results):
    """8·b·s·h·(t-1)/t elements per layer and micro-batch, plus 4 for the vocab-parallel ends;
    and, as Megatron does under sequence parallelism, the all-gather of each column-parallel
    input again in backward from the shard it kept (parallel/tensor/sharded_inputs.py): 2 per layer and
    1 for the output layer."""
    run = tp2_results[0][0]
    cfg = tiny_config(TP2_LAYOUTS[0])
    unit = cfg.train.global_batch * cfg.train.seq_len * cfg.model.dim * (2 - 1) / 2
    expected = 4 * unit * (10 * cfg.model.n_layers + 5)
    assert abs(run.comm["tp"] - expected) / expected < 0.01, (run.comm, expected)


def test_bf16_dp2_tp2_tracks_fp32(four_rank_results):
    """bf16 compute with fp32 master weights: losses within 2% of the fp32 single-process run
    (bf16 keeps 8 bits of mantissa; 6 steps of a tiny model drift by well under that)."""
    want = reference({"train": {"dtype": "fp32"}})
    for rank_results in four_rank_results:
        got = rank_results[-1]
        for step, (a, b) in enumerate(zip(got.losses, want.losses), 1):
            assert abs(a - b) <= 0.02 * b, f"step {step}: bf16 {a} vs fp32 {b}"
        assert got.losses != want.losses  # it really ran in bf16
