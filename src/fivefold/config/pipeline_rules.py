"""What a pipeline layout needs, said once: validation (config/validate.py) raises these sentences
and the planner's search (plan/search.py) skips the layouts they name, so the search never
proposes a layout the trainer refuses nor drops one it runs (tests/test_refusal_agreement.py
checks the two over every layout the search enumerates for the shipped configs).

They are torch.distributed.pipelining's own requirements (torch 2.13) in our terms, and plain
functions of numbers: the search asks them of thousands of layouts per question.
"""

from __future__ import annotations

from fivefold.config.schedules import (SINGLE_STAGE_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES,
                                       parse_layer_counts)


def pipeline_problem(pp: int, virtual: int, schedule: str, n_layers: int, pp_layers: str = "",
                     recompute: str = "none", eval_every: int = 0, mtp_depth: int = 0,
                     tie_embeddings: bool = False) -> str | None:
    """The first rule of the stages, the schedule and the layer split this layout breaks (one
    sentence), or None. Nothing to check without a pipeline (its keys are ignored, and said so)."""
    if pp == 1:
        return None
    if schedule in SINGLE_STAGE_SCHEDULES and virtual != 1:
        return (f"parallel.pp_schedule='{schedule}' runs one stage per rank, so parallel.pp_virtual "
                f"must be 1, got {virtual}; use 'interleaved_1f1b' or 'zb' for virtual stages")
    if schedule in V_SCHEDULES:
        if virtual != 2:
            return (f"parallel.pp_schedule='{schedule}' runs two stages per rank in a V, so "
                    f"parallel.pp_virtual must be 2, got {virtual}")
        if eval_every:  # torch 2.13's V schedules run backward actions in their forward-only eval() too
            return (f"train.eval_every={eval_every} cannot evaluate under parallel.pp_schedule='{schedule}' "
                    "(torch's V schedules have no forward-only run); use 'zb', '1f1b' or "
                    "'interleaved_1f1b', or set train.eval_every = 0")
    elif schedule not in SINGLE_STAGE_SCHEDULES and virtual < 2:
        return (f"parallel.pp_schedule='{schedule}' interleaves virtual stages: set parallel.pp_virtual "
                f">= 2 (got {virtual}), or use '1f1b'")
    split = schedule in SPLIT_BACKWARD_SCHEDULES
    # The weight pass backwards through each block a second time, which torch's selective
    # activation checkpointing refuses ("backward an extra time") inside the step.
    if split and recompute == "selective":
        return (f"parallel.pp_schedule='{schedule}' splits each backward into an input and a weight pass, "
                "which PyTorch's selective recomputation cannot run twice over one block; use "
                "train.recompute = 'full' or 'none' with it, or pp_schedule '1f1b' or 'interleaved_1f1b' "
                "with 'selective'")
    # The last stage then reads the one matrix three times (output layer, MTP embedding and head),
    # and torch's weight pass fails on it ("backward through the graph a second time").
    if split and mtp_depth and tie_embeddings:
        return (f"parallel.pp_schedule='{schedule}' cannot run multi-token prediction (model.mtp_depth="
                f"{mtp_depth}) with tied embeddings: PyTorch's split weight pass fails on the matrix the "
                "last stage reads three times; set model.tie_embeddings = false, or use pp_schedule "
                "'1f1b' or 'interleaved_1f1b'")
    stages = pp * virtual
    if stages > n_layers:
        return (f"parallel.pp*pp_virtual = {stages} stages exceed model.n_layers={n_layers}; every "
                "stage needs at least one layer")
    if pp_layers:
        return _layer_split_problem(pp_layers, stages, n_layers)
    return None


def _layer_split_problem(pp_layers: str, stages: int, n_layers: int) -> str | None:
    try:
        counts = parse_layer_counts(pp_layers)
    except ValueError:
        return f"parallel.pp_layers='{pp_layers}' must be comma-separated layer counts, e.g. '3,5'"
    if len(counts) != stages:
        return (f"parallel.pp_layers='{pp_layers}' has {len(counts)} entries but there are "
                f"parallel.pp*pp_virtual = {stages} stages")
    if sum(counts) != n_layers:
        return f"parallel.pp_layers='{pp_layers}' adds up to {sum(counts)} layers but model.n_layers={n_layers}"
    if min(counts) < 1:
        return f"parallel.pp_layers='{pp_layers}' gives a stage no layer; every stage needs at least one"
    return None


def micro_batch_problem(pp: int, virtual: int, schedule: str, n_micro: int, fix: str) -> str | None:
    """The schedule's rule on the micro-batches per step (n_micro), or None; `fix` ends the sentence
    with what to change, in the asker's terms."""
    if pp == 1:
        return None
    stages = pp * virtual
    if schedule in ("1f1b", "dualpipev") and n_micro < stages:
        return (f"parallel.pp_schedule='{schedule}' needs at least as many micro-batches as stages "
                f"({stages}) but a step has {n_micro}; {fix}")
    if schedule in ("interleaved_1f1b", "zb"):
        # torch runs them in rounds of max(1, n // pp) and needs whole rounds
        rounds = max(1, n_micro // pp)
        if n_micro % rounds:
            return (f"parallel.pp_schedule='{schedule}' runs {n_micro} micro-batches per step in "
                    f"{rounds} rounds (micro-batches // parallel.pp={pp}), which torch needs to divide "
                    f"them; {fix}")
    return None
