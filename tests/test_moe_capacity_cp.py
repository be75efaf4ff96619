"""A capacity factor under context parallelism equals the single process (losses, gradient norms,
final weights; fp32, 6 steps): each cp rank holds two chunks of every sequence, and capacity ranks
each assignment among its expert's in the whole sequence from per-chunk counts gathered over cp
(models/moe/layer.py `_pieces_keep`, parallel/context/apply.py `SequencePieces`)."""

import pytest

from layouts import assert_same_run, reference, run_layouts, tiny_config
from ranks import run_on_ranks

# As tests/test_expert_parallel.py: 4 experts of width 64, top-2, in both layers of the tiny model.
MOE = {"n_experts": 4, "top_k": 2, "expert_ffn_dim": 64}


def layout(parallel: dict, train: dict | None = None, **moe) -> dict:
    return {"model": {"moe": {**MOE, **moe}}, "parallel": parallel, **({"train": train} if train else {})}


LAYOUTS = [
    layout({"cp": 2}, capacity_factor=1.0),  # ring, aux loss
    layout({"cp": 2}, capacity_factor=0.5),
    layout({"cp": 2, "cp_method": "allgather"}, capacity_factor=1.0),
    layout({"cp": 2, "cp_method": "ulysses"}, capacity_factor=0.5),
    layout({"cp": 2, "ep": 2}, capacity_factor=1.0, balance="bias"),
    # Full recomputation repeats the count gather inside backward, on every cp rank alike.
    layout({"cp": 2, "ep": 2}, {"micro_batch": 2, "recompute": "full"}, capacity_factor=0.5, score="sigmoid"),
]


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(2, run_layouts, LAYOUTS)


def _label(one: dict) -> str:
    return f"{one['parallel']} {one['model']['moe']} {one.get('train', {})}"


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[_label(l) for l in LAYOUTS])
def test_capacity_under_cp_equals_one_process(runs, index):
    want = reference(LAYOUTS[index])
    for rank, rank_runs in enumerate(runs):
        assert_same_run(rank_runs[index], want, label=f"{_label(LAYOUTS[index])} rank {rank}")


@pytest.mark.parametrize("capacity_factor", [1.0, 0.5])
def test_these_capacities_drop(capacity_factor):
    """Not vacuous: the compared runs really drop assignments (single process, same settings)."""
    from fivefold.train.trainer import train

    records = train(tiny_config(layout({}, capacity_factor=capacity_factor))).records
    assert all(r["moe_dropped_tokens"] > 0 for r in records), [r["moe_dropped_tokens"] for r in records]
