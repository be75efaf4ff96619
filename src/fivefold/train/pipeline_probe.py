"""Measure the saved activations a pipeline rank holds at its peak during one step, in bytes.

A pipeline runs forwards and backwards interleaved, so what one forward keeps
(train/activation_probe.py) is not enough: the peak is the sum over the micro-batches in flight
(forward done, backward not yet) at the worst moment of the schedule. This probe runs one real
step of the schedule and, after every action of this rank's stages (each forward and its loss,
each backward or input-gradient pass, each weight-gradient pass), adds up
  - the storages created by the forwards and losses of this step that something other than the
    probe still references (autograd's saved tensors, what recomputation keeps, a stage output
    kept by the schedule, a send in flight) — the dispatch-mode method of activation_probe.py,
    with the weights' compute-dtype casts left out in the same way;
  - the received input of every micro-batch a non-first stage holds for its backward: it lands in
    a receive buffer the schedule allocated before the step (not created by a forward, so the first
    rule misses it), and it is that stage's first saved tensor.
Each storage counts once. What backward creates (recomputed activations, gradients) is working
memory, as in the planner, and not counted. The largest sum over the step is the peak.
"""

from __future__ import annotations

import torch

from fivefold.torch_internals import (schedule_loss_fn, set_schedule_loss_fn, stage_backward_state, stage_fwd_cache,
                                      storage_use_count, tree_leaves, wrap_stage_method)
from fivefold.train.activation_probe import Created, plain_tensors


class _CreatedInForwards(Created):
    """Created over many forwards: a tensor an operator reads that no forward of the step created
    (a weight's cast that autocast cached before the first measured forward, a receive buffer) is
    not an activation, nor is a view of it (the cached cast's transpose): its storage joins the
    uncounted ones, held, so that a later storage cannot take its address."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                for tensor in plain_tensors(leaf):
                    storage = tensor.untyped_storage()
                    ptr = storage.data_ptr()
                    if ptr not in self.storages and ptr not in self.existing:
                        self.casts.setdefault(ptr, storage)
        return super().__torch_dispatch__(func, types, args, kwargs)


class _PipelineProbe:
    def __init__(self, pipeline, existing: set[int], parameters: set[int]):
        self.pipeline = pipeline
        # One mode collects every storage this step's forwards create (entered per action).
        self.created = _CreatedInForwards(existing, parameters)
        self.peak = 0
        self.trace: list[tuple[str, int, int, int]] = []  # (action, stage, micro-batch, bytes after)

    def held_bytes(self) -> int:
        kept = {ptr: s for ptr, s in self.created.storages.items() if storage_use_count(s) > 1}
        for stage in self.pipeline.stages:
            if stage.is_first:
                continue  # its input is the token ids, not an activation
            held = [inputs for _, inputs in stage_fwd_cache(stage).values()]
            held += [state[0] for state in stage_backward_state(stage).values()]  # waiting for the weight pass
            for inputs in held:
                for value in inputs:
                    for tensor in plain_tensors(value):
                        storage = tensor.untyped_storage()
                        kept.setdefault(storage.data_ptr(), storage)
        return sum(s.nbytes() for s in kept.values())

    def sample(self, action: str, stage_index: int, micro: int) -> None:
        held = self.held_bytes()
        self.peak = max(self.peak, held)
        self.trace.append((action, stage_index, micro, held))

    def wrap(self, stage) -> dict:
        """Replace the stage's actions with measured ones; returns the originals to restore."""
        originals = {}
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            def measuring(method, _name=name):
                def measured(micro, *args, **kwargs):
                    if _name == "forward_one_chunk":
                        with self.created:
                            out = method(micro, *args, **kwargs)
                    else:
                        out = method(micro, *args, **kwargs)
                    self.sample(_name, stage.stage_index, micro)
                    return out
                return measured
            originals[name] = wrap_stage_method(stage, name, measuring)
        return originals


def pipeline_peak_bytes(par, batch: torch.Tensor, n_micro: int, autocast) -> tuple[int, list]:
    """(peak bytes of saved activations held by this pipeline rank, the trace of samples) over one
    forward + backward step of `batch` (this rank's windows of the global batch). The gradients
    it leaves are not applied: nothing is trained."""
    pipeline = par.pipeline
    if pipeline is None:
        raise ValueError("pipeline_peak_bytes measures pipelined layouts; use activation_probe")
    parameters = set()
    for part in par.parts:
        for tensor in [*part.parameters(), *part.buffers()]:
            for plain in plain_tensors(tensor):
                parameters.add(plain.untyped_storage().data_ptr())
    probe = _PipelineProbe(pipeline, set(parameters), parameters)
    originals = [probe.wrap(stage) for stage in pipeline.stages]
    schedule = pipeline.schedule
    loss_fn = schedule_loss_fn(schedule)

    def measured_loss(output, target, **kwargs):  # the loss's saved tensors are the last stage's
        with probe.created:
            loss = loss_fn(output, target, **kwargs)
        probe.sample("loss", pipeline.n_stages - 1, -1)
        return loss
    set_schedule_loss_fn(schedule, measured_loss)
    try:
        par.forward_backward(batch, n_micro, autocast)
    finally:
        set_schedule_loss_fn(schedule, loss_fn)
        for stage, methods in zip(pipeline.stages, originals):
            for name, method in methods.items():
                wrap_stage_method(stage, name, lambda _, original=method: original)
    peak, trace = probe.peak, probe.trace
    probe = None  # the probe holds every sampled tensor: let it go before zero_grad
    for part in par.parts:
        part.zero_grad(set_to_none=True)
    return peak, trace
