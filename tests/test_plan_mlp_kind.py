"""Two-matrix MLPs (GeLU, squared ReLU: GPT-3, Nemotron-4) in the planner, issue 41: model statistics
with 2 h f MLP parameters are priced as what such an MLP runs and keeps, not as a SwiGLU look-alike:
two GEMMs (models/decoder_stats.py ModelStats.mlp_matrices), and activations of the up projection's output and the
activation's output (plan/memory/activations.py) instead of SwiGLU's gate, up and product."""

from __future__ import annotations

import dataclasses

import pytest

from fivefold.configure import load_config
from fivefold.plan.memory.activations import layer_activation_bytes, layer_activation_elements
from fivefold.plan.estimate import estimate
from fivefold.plan.speed.gemm import layer_gemms
from fivefold.plan.hardware import hardware_for
from fivefold.plan.speed.frameworks import runtime_for
from fivefold.plan.layout import Layout
from fivefold.plan.workload import workload_from_config


def _workloads():
    cfg = load_config(None, ["--model.preset", "llama3-8b", "--train.seq_len", "4096", "--train.global_batch", "16",
                             "--train.dtype", "bf16"])
    swiglu = workload_from_config(cfg)
    s = swiglu.stats
    two = dataclasses.replace(swiglu, stats=dataclasses.replace(s, dense_mlp_params=2 * s.dim * s.ffn_dim))
    return swiglu, two


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_a_two_matrix_mlp_keeps_one_ffn_wide_tensor_fewer(recompute):
    """fivefold's block: SwiGLU keeps gate, up and their product (selective: gate and up), a
    two-matrix MLP the up output and the activation's output (selective: the up output)."""
    swiglu, two = _workloads()
    layout, hw = Layout(mbs=1, recompute=recompute), hardware_for("h100")
    f, bf16 = swiglu.stats.ffn_dim, 2
    diff = (layer_activation_bytes(swiglu, 0, layout, recompute, hw, runtime_for())
            - layer_activation_bytes(two, 0, layout, recompute, hw, runtime_for()))
    assert diff == f * bf16


def test_the_korthikanti_count_of_a_two_matrix_mlp():
    """Korthikanti et al.'s per-layer count (the nanotron recipe): an MLP keeps its up output and the
    activation's output, 2f; selective recomputation drops the activation's output."""
    swiglu, two = _workloads()
    f = swiglu.stats.ffn_dim
    for recompute, kept in (("none", 2 * f), ("selective", f)):
        swiglu_mlp = 4 * f - (f if recompute == "selective" else 0)
        diff = (layer_activation_elements(swiglu.stats, 0, Layout(), 4096, recompute, True)
                - layer_activation_elements(two.stats, 0, Layout(), 4096, recompute, True))
        assert diff == swiglu_mlp - kept


def test_a_two_matrix_mlp_runs_two_gemms_and_two_thirds_of_the_flops():
    swiglu, two = _workloads()
    dense, _ = layer_gemms(two.stats, False, 4096, 1, 1)
    assert sum(g.count for g in dense) == 4 + 2  # q, k, v, o; up, down
    s = swiglu.stats
    assert (swiglu.stats.layer_flops_per_token(0, 4096) - two.stats.layer_flops_per_token(0, 4096)
            == 6 * s.dim * s.ffn_dim)
    hw, runtime, layout = hardware_for("h100"), runtime_for(), Layout(mbs=1)
    assert estimate(two, layout, hw, runtime).time_parts["compute"] < \
        estimate(swiglu, layout, hw, runtime).time_parts["compute"]
