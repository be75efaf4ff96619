"""Every `parallel.order` that validation accepts builds and trains equal to one process (issue 19):
one 8-rank group runs each accepted order once, on 2x2x2 layouts taking turns, so every order is
tried with three of the four dimensions at 2 (the fourth, at 1, does not change the rank grid)."""

import itertools

import pytest

from layouts import assert_same_run, reference, run_layouts, tiny_config
from ranks import run_on_ranks

FAMILIES = [  # (parallel keys, weight bound): tp reassociates row-parallel sums (tests/test_pipeline.py)
    ({"dp": 2, "tp": 2, "pp": 2, "zero": 1}, 1e-4),
    ({"dp": 2, "cp": 2, "tp": 2, "zero": 1}, 1e-4),
    ({"dp": 2, "cp": 2, "pp": 2, "zero": 2}, 1e-5),
]


def accepted_orders() -> list[str]:
    from fivefold.config import ConfigError
    from fivefold.configure import validate

    out = []
    for dims in itertools.permutations(["pp", "dp", "cp", "tp"]):
        order = ",".join(dims)
        try:
            validate(tiny_config({"parallel": {"order": order}}))
        except ConfigError:
            continue
        out.append(order)
    return out


ORDERS = accepted_orders()
LAYOUTS = [{"train": {"micro_batch": 1}, "parallel": {**FAMILIES[i % len(FAMILIES)][0], "order": order}}
           for i, order in enumerate(ORDERS)]


def test_orders_with_cp_outside_dp_are_refused():
    from fivefold.config import ConfigError
    from fivefold.configure import validate

    with pytest.raises(ConfigError, match=r"parallel.order='cp,dp,pp,tp' puts cp outside dp, .*put dp before cp"):
        validate(tiny_config({"parallel": {"order": "cp,dp,pp,tp"}}))
    assert len(ORDERS) == 12  # the 24 orders less the 12 with cp before dp


def _orders_then_elastic(layouts: list[dict], saved: str):
    from fivefold.train.trainer import train

    # parallel.dp = 0 on 8 ranks: dp8 continues a one-process run's checkpoint (elastic growth)
    resumed = train(tiny_config({"parallel": {"dp": 0}, "checkpoint": {"resume": saved}}))
    return run_layouts(layouts), ([r["step"] for r in resumed.records], resumed.losses)


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    """A single-process run's checkpoint of step 3 of 6, for the 8 ranks to continue."""
    from fivefold.train.trainer import train

    root = tmp_path_factory.mktemp("one-process")
    train(tiny_config({"checkpoint": {"dir": str(root), "every": 3}}))
    return str(root / "step_00000003")


@pytest.fixture(scope="module")
def spawned(grown):
    return run_on_ranks(8, _orders_then_elastic, LAYOUTS, grown)


@pytest.fixture(scope="module")
def order_results(spawned):
    return [layouts for layouts, _ in spawned]


def test_one_process_checkpoint_continues_on_eight_ranks_with_dp_from_the_world_size(spawned):
    want = reference({}).losses[3:]
    for rank, (_, (steps, losses)) in enumerate(spawned):
        assert steps == [4, 5, 6], f"rank {rank}"
        assert losses == pytest.approx(want, rel=1e-5), f"rank {rank}"


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[str(l["parallel"]) for l in LAYOUTS])
def test_order_trains_like_one_process(order_results, index):
    layout = LAYOUTS[index]
    want = reference(layout)
    atol = FAMILIES[index % len(FAMILIES)][1]
    for rank, results in enumerate(order_results):
        assert_same_run(results[index], want, weight_atol=atol, label=f"{layout['parallel']} rank {rank}")
