"""The planner: predict memory, communication, pipeline bubble and speed of any 5D layout, and
search the best one. Pure Python arithmetic: no torch, answers in milliseconds.

    from fivefold.plan import plan_layout, search_layouts
"""

from fivefold.plan.compile_choice import planned_compile
from fivefold.plan.estimate import Estimate, estimate
from fivefold.plan.hardware import PROFILES, Hardware, Runtime, hardware_for
from fivefold.plan.speed.frameworks import DEFAULT_RUNTIME, runtime_for
from fivefold.plan.layout import Layout, parse_layout
from fivefold.plan.model_stats import ModelStats, model_stats
from fivefold.plan.search import SearchResult, search
from fivefold.plan.workload import PRECISIONS, Workload, workload_from_config


def plan_layout(cfg, layout: Layout, gpu: str | None = None) -> Estimate:
    """Predict one layout for a resolved Config on its [cluster] GPU (or `gpu`), with the runtime
    profile of its train.compile."""
    hw = hardware_for(gpu or cfg.cluster.gpu, cfg.cluster.gpus_per_node)
    return estimate(workload_from_config(cfg), layout, hw, runtime_for(planned_compile(cfg)))


def search_layouts(cfg, gpus: int | None = None) -> SearchResult:
    """Rank the layouts of a resolved Config on cfg.cluster (or `gpus` GPUs)."""
    hw = hardware_for(cfg.cluster.gpu, cfg.cluster.gpus_per_node)
    return search(cfg, workload_from_config(cfg), hw, runtime_for(planned_compile(cfg)), gpus or cfg.cluster.gpus)


__all__ = ["DEFAULT_RUNTIME", "Estimate", "Hardware", "Layout", "ModelStats", "PRECISIONS",
           "PROFILES", "Runtime", "SearchResult", "Workload", "estimate", "hardware_for",
           "model_stats", "parse_layout", "plan_layout", "search", "search_layouts",
           "workload_from_config"]
