"""The layout search and validation refuse the same layouts: over every layout the search enumerates
for each shipped config on 4 GPUs, the search's quick check (plan/search.py layout_problem, which
reads config/pipeline_rules.py) passes exactly the layouts fivefold.config.validate accepts, so the
search never proposes a layout the trainer refuses, nor skips one it runs."""

import dataclasses

import pytest

from fivefold.config import CheckpointConfig, ConfigError, DataConfig, load_config, shipped
from fivefold.config.validate import validate
from fivefold.plan.layout import config_with_layout
from fivefold.plan.search import candidate_layouts, layout_problem
from fivefold.plan.workload import workload_from_config

GPUS = 4
# finetune.toml takes its model from the folder a run of chat-demo-base.toml writes: that
# config's layouts are checked, and finetune's model is the same one.
NEEDS_A_RUN_FIRST = {"finetune"}


@pytest.mark.parametrize("name", [n for n in shipped.names() if n not in NEEDS_A_RUN_FIRST])
def test_search_and_validation_refuse_the_same_layouts(name):
    cfg = load_config(shipped.resolve(name), {"cluster": {"gpus": GPUS}})
    # The planner plans the model and the layout: the data and checkpoint paths are the run's.
    cfg = dataclasses.replace(cfg, data=DataConfig(), checkpoint=CheckpointConfig())
    workload = workload_from_config(cfg)
    disagreements, checked = [], 0
    for grid in candidate_layouts(cfg, workload, GPUS, cfg.cluster.gpus_per_node):
        for layout in (layout for by_zero in grid for layout in by_zero):
            checked += 1
            search_says = layout_problem(cfg, workload, layout, GPUS, full_check=False)
            try:
                validate(config_with_layout(cfg, layout), GPUS)
                validation_says = None
            except ConfigError as err:
                validation_says = str(err)
            if (search_says is None) != (validation_says is None):
                disagreements.append(f"{layout}: search {search_says or 'accepts'}; "
                                     f"validation {validation_says or 'accepts'}")
    assert checked > 0
    assert not disagreements, f"{len(disagreements)} of {checked}, e.g. {disagreements[:3]}"
