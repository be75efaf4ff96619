"""Pipeline splits the planner prices but fivefold's trainer does not run: chunks without a layer
(an embedding-only first chunk, a head-only last one) and so pp·v up to the layer count plus two.

Llama 3 405B ran that way (Dubey et al. 2024, s3.3.2: 126 layers on pp 16 with interleaving, one
layer per chunk, the first and the last stage one layer short, so that the embedding and the output
layer sit alone). The planner's schedule model takes any non-negative counts (plan/pipeline/schedule.py
parse_pp_layers); fivefold's trainer gives every stage at least one layer
(fivefold.configure.validate). `fivefold plan --layout` evaluates such a split, says in its why that
the trainer would refuse it, and checks every other rule on the nearest split the trainer runs.
"""

from __future__ import annotations

import dataclasses

from fivefold.plan.layout import Layout
from fivefold.plan.pipeline.schedule import chunks_per_rank, parse_pp_layers

NOTE = ("planned only: a chunk without a layer (pp·v above the layers, or a 0 in pp_layers) is what "
        "Megatron and Meta's Llama 3 ran; fivefold's trainer gives every stage at least one layer")


def planner_only(layout: Layout, n_layers: int) -> bool:
    """Whether this layout's split has a chunk without a layer (valid counts otherwise)."""
    if layout.pp <= 1 or not layout.pp_layers:
        return False
    try:
        sizes = parse_pp_layers(layout.pp_layers, layout.pp * chunks_per_rank(layout), n_layers)
    except ValueError:
        return False
    return min(sizes) == 0


def trainer_stand_in(layout: Layout, n_layers: int) -> Layout:
    """The same layout with the trainer's own split and as many chunks per rank as the layers allow
    (at least the schedule's minimum of 2 where it interleaves): what the other rules are checked on."""
    v = layout.pp_virtual
    if chunks_per_rank(layout) > 1:
        v = max(2, min(v, n_layers // layout.pp))
    return dataclasses.replace(layout, pp_layers="", pp_virtual=v)
