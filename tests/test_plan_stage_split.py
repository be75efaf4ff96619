"""Stages balanced by memory too (#40): where the FLOP-balanced split does not fit, the search gives
the pipeline's first (and last) stage fewer layers, as Llama 3 trained, and says why."""

import dataclasses

from fivefold.configure import load_config
from fivefold.configure import validate
from fivefold.plan import hardware_for, runtime_for
from fivefold.plan.layout import config_with_layout, parse_layout
from fivefold.plan.memory.peak import worst_rank_memory
from fivefold.plan.pipeline.schedule import balanced_sizes, parse_pp_layers
from fivefold.plan.search import end_relieved
from fivefold.plan.workload import workload_from_config

LAYOUT = "dp=64,zero=1,tp=8,pp=16,mbs=1,recompute=none,pp_schedule=1f1b"


def _setting():
    cfg = load_config("llama3-405b", ["--train.seq_len", "8192"])
    return cfg, workload_from_config(cfg), hardware_for("h100", 8), runtime_for(False), parse_layout(LAYOUT)


def test_first_stage_gives_up_a_layer_where_the_balanced_split_does_not_fit():
    cfg, workload, hw, runtime, layout = _setting()
    balanced = worst_rank_memory(workload, layout, hw, runtime)
    assert balanced.pipeline_rank == 0  # the first rank: the most micro-batches in flight
    tight = dataclasses.replace(hw, memory_bytes=0.97 * balanced.total)
    relieved, memory, why = end_relieved(workload, layout, tight, runtime, balanced)
    sizes = parse_pp_layers(relieved.pp_layers, 16, workload.stats.n_layers)
    base = balanced_sizes(workload.stats, 16, workload.seq_len)
    assert sizes[0] == base[0] - 1 and sizes[-1] == base[-1] and sum(sizes) == sum(base)
    assert memory.total <= tight.memory_bytes < balanced.total
    assert "first stage 1 layer fewer" in why
    # The trainer takes the split as it is (parallel.pp_layers).
    validated = config_with_layout(cfg, relieved)
    validate(validated, relieved.world_size)
    assert validated.parallel.pp_layers == relieved.pp_layers


def test_no_split_helps_when_the_ends_are_not_the_problem():
    _, workload, hw, runtime, layout = _setting()
    balanced = worst_rank_memory(workload, layout, hw, runtime)
    hopeless = dataclasses.replace(hw, memory_bytes=0.5 * balanced.total)
    assert end_relieved(workload, layout, hopeless, runtime, balanced) is None
    one_stage = dataclasses.replace(layout, pp=1, dp=1024)
    assert end_relieved(workload, one_stage, hopeless, runtime, balanced) is None
