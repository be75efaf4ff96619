"""Data parallelism (every ZeRO stage, HSDP) against the single-process run."""

import pytest

from layouts import assert_same_run, reference, run_layouts
from ranks import run_on_ranks

TWO_RANK_LAYOUTS = [
    {"parallel": {"dp": 2, "zero": 0}},
    {"parallel": {"dp": 2, "zero": 1}},
    {"parallel": {"dp": 2, "zero": 2}},
    {"parallel": {"dp": 2, "zero": 3}},
    # Gradient accumulation: 4 micro-batches of 1 sequence per rank.
    {"parallel": {"dp": 2, "zero": 0}, "train": {"micro_batch": 1}},
    {"parallel": {"dp": 2, "zero": 1}, "train": {"micro_batch": 1}},
    {"parallel": {"dp": 2, "zero": 2}, "train": {"micro_batch": 1}},
    {"parallel": {"dp": 2, "zero": 3}, "train": {"micro_batch": 1}},
]


@pytest.fixture(scope="module")
def two_rank_results():
    return run_on_ranks(2, run_layouts, TWO_RANK_LAYOUTS)


@pytest.mark.parametrize("index", range(len(TWO_RANK_LAYOUTS)))
def test_dp2_matches_single_process(two_rank_results, index):
    layout = TWO_RANK_LAYOUTS[index]
    want = reference(layout)
    for rank, results in enumerate(two_rank_results):
        assert_same_run(results[index], want, label=f"{layout} rank {rank}")
