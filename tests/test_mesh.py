"""ParallelDims: rank arithmetic of the mesh, without any process group."""

import warnings

import pytest

from fivefold.config import ParallelConfig
from fivefold.mesh import ParallelDims


def dims(**kw) -> ParallelDims:
    return ParallelDims.from_config(ParallelConfig(**kw))


def test_default_order_puts_tp_innermost():
    d = dims(dp=2, tp=2, pp=2)
    assert d.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # consecutive ranks: one node
    assert d.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]  # outermost: farthest apart
    assert d.groups("dp_replicate", "dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_custom_order_moves_dimensions():
    d = dims(dp=2, tp=2, order="tp,pp,cp,dp")
    assert d.groups("tp") == [[0, 2], [1, 3]]
    assert d.groups("dp_replicate", "dp_shard") == [[0, 1], [2, 3]]


def test_hsdp_splits_dp_into_replicate_and_shard():
    d = dims(dp=4, zero=3, dp_shard=2)
    assert (d.dp_replicate, d.dp_shard, d.dp) == (2, 2, 4)
    assert d.groups("dp_shard") == [[0, 1], [2, 3]]
    assert d.groups("dp_replicate") == [[0, 2], [1, 3]]


def test_every_rank_in_exactly_one_group_per_dimension():
    d = dims(dp=2, tp=2, pp=2, cp=2)
    for names in (("tp",), ("cp",), ("pp",), ("dp_replicate", "dp_shard")):
        flat = sorted(r for g in d.groups(*names) for r in g)
        assert flat == list(range(16)), names


def test_coordinates_round_trip():
    d = dims(dp=2, tp=2, pp=2, cp=2)
    for rank in range(16):
        c = d.coordinates(rank)
        assert d.rank_grid()[tuple(c[n] for n, _ in d.mesh_dims)] == rank
    assert d.coordinates(5) == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 1}


def test_warns_when_tp_spans_nodes():
    with pytest.warns(UserWarning, match=r"tensor-parallel group \[0, 2\] spans nodes"):
        dims(dp=2, tp=2, order="tp,pp,cp,dp").warn_if_tp_crosses_nodes(ranks_per_node=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dims(dp=2, tp=2).warn_if_tp_crosses_nodes(ranks_per_node=2)  # default order: no warning
