"""Tensor (+ sequence) parallelism alone and with data parallelism, against the single-process run."""

import pytest

from layouts import assert_same_run, reference, run_layouts
from ranks import run_on_ranks

TP2_LAYOUTS = [
    {"parallel": {"tp": 2, "sp": True}},
    {"parallel": {"tp": 2, "sp": False}},
    {"parallel": {"tp": 2}, "train": {"micro_batch": 2}},
]
FOUR_RANK_LAYOUTS = [
    {"parallel": {"tp": 4}, "model": {"n_kv_heads": 4}},  # tp must divide the kv heads
    {"parallel": {"dp": 2, "tp": 2, "zero": 1}},
    {"parallel": {"dp": 2, "tp": 2, "zero": 3}},
    {"parallel": {"dp": 2, "tp": 2, "zero": 1}, "train": {"micro_batch": 1}},
    {"parallel": {"dp": 2, "tp": 2, "zero": 3}, "train": {"micro_batch": 1}},
    {"parallel": {"dp": 4, "zero": 3, "dp_shard": 2}},
]


@pytest.fixture(scope="module")
def tp2_results():
    return run_on_ranks(2, run_layouts, TP2_LAYOUTS)


@pytest.fixture(scope="module")
def four_rank_results():
    return run_on_ranks(4, run_layouts, FOUR_RANK_LAYOUTS)


@pytest.mark.parametrize("index", range(len(TP2_LAYOUTS)))
def test_tp2(tp2_results, index):
    layout = TP2_LAYOUTS[index]
    want = reference(layout)
    for rank, results in enumerate(tp2_results):
        assert_same_run(results[index], want, label=f"{layout} rank {rank}")


@pytest.mark.parametrize("index", range(len(FOUR_RANK_LAYOUTS)))
def test_four_ranks(four_rank_results, index):
    layout = FOUR_RANK_LAYOUTS[index]
    want = reference(layout)
    for rank, results in enumerate(four_rank_results):
        assert_same_run(results[index], want, label=f"{layout} rank {rank}")
