"""Under sequence parallelism, the layers that read the gathered sequence keep only this rank's
shard of it for backward and all-gather it again there (Megatron's layout).

Each column-parallel matmul needs its input again in backward, for its weight's gradient. That
input is the stream all-gathered over the tp ranks: tp times the size of the shard it came from,
once per sub-layer (attention, MLP, the output layer). Kept as autograd would keep it, it is the
largest activation of a block at tp 4 and more without recomputation. Instead the gather marks its
output with a `Regather` (the shard and how to gather it again); the layers reading that output
save it through saved-tensor hooks that store the mark, and backward gathers the shard once more,
once for all the layers that read the same input (q, k and v share one gather). The cost is one
all-gather per sub-layer in backward; `parallel.sp_keep_gathered = true` keeps the gathered
inputs instead (faster where the memory is there: no gather in backward).

Only without recomputation: recomputation re-gathers in backward already (the gather is recomputed
with the rest of the block). Compiled blocks keep what the compiler's partitioner keeps.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.graph import saved_tensors_hooks

_MARK = "_fivefold_regather"


class Regather:
    """A gathered input's shard and the gather that rebuilds it; shared by every layer saving it.
    The rebuilt input is kept from the first layer's backward to the last one's."""

    def __init__(self, shard: torch.Tensor, gather):
        self.shard, self.gather = shard.detach(), gather
        self.packed = self.unpacked = 0
        self.value = None

    def unpack(self, size, stride, offset) -> torch.Tensor:
        if self.value is None:
            self.value = self.gather(self.shard)
        value = self.value
        self.unpacked += 1
        if self.unpacked >= self.packed:  # every saver has it: drop ours (a later unpack gathers again)
            self.value, self.unpacked = None, 0
        return value.as_strided(size, stride, offset)


def mark(gathered: torch.Tensor, shard: torch.Tensor, gather) -> torch.Tensor:
    """Mark `gathered` (= gather(shard), contiguous) as rebuildable from `shard`."""
    setattr(gathered, _MARK, Regather(shard, gather))
    return gathered


def saving_shards(x: torch.Tensor):
    """A context under which tensors saved for backward that are `x` or views of it are stored as
    its mark (when x is marked); everything else is stored as it is."""
    regather = getattr(x, _MARK, None)
    if regather is None or not torch.is_grad_enabled():
        return contextlib.nullcontext()
    storage = x.untyped_storage().data_ptr()

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() != storage:
            return t  # the weight: an input of the matmul, kept as autograd keeps it
        regather.packed += 1
        return regather, tuple(t.size()), tuple(t.stride()), t.storage_offset()

    def unpack(packed):
        if isinstance(packed, tuple):
            regather_, size, stride, offset = packed
            return regather_.unpack(size, stride, offset)
        return packed

    return saved_tensors_hooks(pack, unpack)


def keeps_shards(cfg, compiled: bool) -> bool:
    """Whether a run's column-parallel layers save the shard of their gathered input (the
    planner's memory, plan/memory/activations.py, asks the same); `compiled`: whether its blocks compile
    (train.compile as plan/compile_choice.py resolves it)."""
    t, p = cfg.train, cfg.parallel
    return p.tp > 1 and p.sp and t.recompute == "none" and not compiled and not p.sp_keep_gathered
