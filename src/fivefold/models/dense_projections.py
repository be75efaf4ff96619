"""The dense projections of a block: the modules the family's tensor-parallel plan lays out as
Megatron's dense projections (`TP.COLUMN`, `TP.ROW_TO_SEQUENCE`, `TP.ROW_TO_TOKENS`: attention's four
projections and a dense MLP's three in the decoder families). A role the ModelSpec already gives,
so FP8 training (parallel/float8.py) and the machine stage of the gate (configure/machine.py, which
checks their sizes against the FP8 kernel's) find them by it, without naming a family's modules.
"""

from __future__ import annotations

from torch import nn

from fivefold.models.spec import TP, ModelSpec

DENSE_PROJECTION_STYLES = (TP.COLUMN, TP.ROW_TO_SEQUENCE, TP.ROW_TO_TOKENS)


def dense_projection_paths(spec: ModelSpec, cfg_model, part: nn.Module) -> dict[str, list[str]]:
    """Block index -> paths (inside the block) of its dense projections."""
    return {index: [path for path, style in spec.block_plan(cfg_model, int(index)).items()
                    if style in DENSE_PROJECTION_STYLES]
            for index in part.layers.keys()}
