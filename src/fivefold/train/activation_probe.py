"""Measure what one micro-batch's forward keeps for backward, on this rank, in bytes.

The planner predicts activation bytes (plan/memory/activations.py); this is the measurement it is checked
against. While the forward and the loss run, a dispatch mode holds on to the storage of every
tensor an operator creates; at the end, the storages that something else still references
(autograd's saved tensors, what activation checkpointing keeps, the logits for the loss) are
what the step holds for backward. Compute-dtype copies of the parameters (autocast's bf16 weights,
the experts' cast) are left out: they scale with the parameters, not the tokens, and the planner
counts them apart (memory 'other'). Unlike saved-tensor hooks this also sees what
torch.utils.checkpoint keeps, so 'selective' and 'full' recomputation are measured like 'none';
unlike allocator totals it is not disturbed by communication buffers freed late on other threads.

Works for layouts without a pipeline (a pipeline runs forward and backward interleaved: its
peak over a whole step is train/pipeline_probe.py's measurement, with this module's mode).
"""

from __future__ import annotations

import torch

from fivefold.torch_internals import (TorchDispatchMode, aten_op, is_traceable_wrapper_subclass, storage_use_count,
                                      tree_leaves)


def plain_tensors(tensor: torch.Tensor):
    """The plain tensors holding a tensor's data: a DTensor's (or an async collective result's)
    local tensor; the mode sees the subclass, not the local operators inside it."""
    if not isinstance(tensor, torch.Tensor):
        return
    if is_traceable_wrapper_subclass(tensor):
        for name in tensor.__tensor_flatten__()[0]:
            yield from plain_tensors(getattr(tensor, name, None))
    elif tensor.device.type != "meta":
        yield tensor


class Created(TorchDispatchMode):
    """Holds the storage of every tensor an operator returns (one reference each). A cast of a
    parameter goes to `casts` instead: held too (so that no later storage can take its address),
    never counted."""

    def __init__(self, existing: set[int], parameters: set[int]):
        super().__init__()
        self.existing = existing
        self.parameters = parameters
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.casts: dict[int, torch.UntypedStorage] = {}
        self.to_copy = aten_op("_to_copy").default

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        weight_cast = func is self.to_copy and any(
            t.untyped_storage().data_ptr() in self.parameters for t in plain_tensors(args[0]))
        for leaf in tree_leaves(out):
            if not isinstance(leaf, torch.Tensor):
                continue
            for tensor in plain_tensors(leaf):
                storage = tensor.untyped_storage()
                ptr = storage.data_ptr()
                if ptr in self.existing or ptr in self.casts or not storage.nbytes():
                    continue
                if weight_cast:  # a weight's compute-dtype copy: model state, not an activation
                    self.casts[ptr] = storage
                else:
                    self.storages.setdefault(ptr, storage)
        return out

    def kept_bytes(self) -> int:
        # One reference is ours: a storage someone else also holds is kept for backward.
        return sum(s.nbytes() for s in self.storages.values() if storage_use_count(s) > 1)


def forward_kept_bytes(par, batch: torch.Tensor, autocast) -> int:
    """Bytes that the forward + loss of `batch` (one micro-batch of this rank) leave referenced."""
    if par.pipeline is not None:
        raise ValueError("forward_kept_bytes measures layouts without pipeline parallelism")
    inputs, labels, positions = par.split_sequence(batch)
    existing = {t.untyped_storage().data_ptr() for t in (inputs, labels, positions) if t is not None}
    parameters = set()
    for part in par.parts:
        for tensor in [*part.parameters(), *part.buffers()]:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            parameters.add(local.untyped_storage().data_ptr())
    existing |= parameters
    mode = Created(existing, parameters)
    with mode, autocast():
        loss = par.forward_loss(inputs, labels, positions)
    kept = mode.kept_bytes()
    del loss, mode  # frees the graph: nothing is trained
    return kept
