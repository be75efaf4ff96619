"""Data parallelism: how gradients meet and where optimizer state lives, for each ZeRO stage.

- zero 0: every rank keeps everything; gradients are all-reduced in buckets that start while the
  backward pass is still running (ours: DDP cannot hold tensor-parallel DTensor parameters).
- zero 1 / 2: optimizer state (and, at 2, gradients) sharded over dp; see parallel/zero.py.
- zero 3: parameters sharded too, with PyTorch's FSDP2 `fully_shard` per transformer block.
HSDP (`dp_shard` < dp) shards inside groups of dp_shard ranks and replicates across groups.

Every variant reduces the gradients of a step once, after its last micro-batch (zero 2 instead
reduce-scatters each micro-batch, also under a pipeline, which is what keeps its gradients sharded).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from fivefold.config import Config
from fivefold.mesh import ParallelDims
from fivefold.parallel.buckets import Bucket, make_buckets
from fivefold.parallel.expert import is_expert_param
from fivefold.parallel.grad_norm import (clip_coefficient, copies_of_local_piece, global_norm,
                                         local_tensor, settle_grad_layout, weighted_square_sum)


def trainable(parts: list[nn.Module]) -> list[nn.Parameter]:
    """Each trainable parameter once, even when two parts (pipeline stages) share it."""
    seen, params = set(), []
    for part in parts:
        for param in part.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


class DataParallel:
    """Whole-tensor gradients and optimizer (no data parallelism: dp = 1).

    `parts` are this rank's model parts: the model, or the pipeline stages this rank runs."""

    name = "no data parallelism"

    def __init__(self, parts: list[nn.Module], dims: ParallelDims):
        self.parts, self.dims = parts, dims
        self.params = trainable(parts)
        self.norm_world = dims.world_size // dims.pp  # ranks that together hold one full model
        # Parameters held on more ranks than the layout says (a tied embedding split across the
        # first and last pipeline stage): id -> extra factor on their copies.
        self.extra_copies: dict[int, int] = {}
        # Expert parameters under expert parallelism: each ep rank holds different experts, and their
        # gradients meet over the expert-data-parallel group instead of dp·cp (parallel/expert.py).
        self.expert_ids = ({id(p) for part in parts for n, p in part.named_parameters() if is_expert_param(n)}
                           if dims.ep > 1 else set())

    def copies(self, param: torch.Tensor) -> int:
        copies = copies_of_local_piece(param, self.norm_world) * self.extra_copies.get(id(param), 1)
        return copies // self.dims.ep if id(param) in self.expert_ids else copies

    def reduction_buckets(self, padded_to, group, group_rank, expert_group, expert_rank,
                          params=None) -> list[Bucket]:
        """Buckets of dense parameters, reduced over `group`, and apart of expert parameters, reduced
        over the expert-data-parallel group. Every gradient is divided by all dp·cp ranks: an expert
        already summed the tokens of its whole ep group. Each bucket carries its group, its size,
        this rank's place in it (None: not needed) and the gradient scale. `params`: a subset of
        this rank's parameters (default all)."""
        params = self.params if params is None else params
        dense = [p for p in params if id(p) not in self.expert_ids]
        expert = [p for p in params if id(p) in self.expert_ids]
        buckets = []
        for params, grp, rank in ((dense, group, group_rank), (expert, expert_group, expert_rank)):
            if not params:
                continue
            size = dist.get_world_size(grp)
            pad = size if padded_to is None else padded_to
            for bucket in make_buckets(params, padded_to=pad):
                bucket.group, bucket.group_size, bucket.group_rank = grp, size, rank
                bucket.scale = 1.0 / (self.dims.dp * self.dims.cp)  # HSDP's replica all-reduce adds, too
                buckets.append(bucket)
        return buckets

    @contextlib.contextmanager
    def grad_sync(self, is_last: bool):
        """Wraps one micro-batch's forward and backward; `is_last` marks the step's last one."""
        self.begin_micro_batch(is_last)
        yield
        self.end_micro_batch()

    def begin_micro_batch(self, is_last: bool) -> None:
        pass

    def sum_tied(self, pipeline, group) -> None:
        """Sum the gradients of a pipeline's tied embedding copies (`group`: the ranks holding them)."""
        pipeline.sum_tied_grads(group)

    def end_micro_batch(self) -> None:
        pass

    def finish_grads(self) -> None:
        for param in self.params:
            settle_grad_layout(param)

    def clip_grad_norm(self, max_norm: float) -> float:
        with_grads = [p for p in self.params if p.grad is not None]
        grads = [p.grad for p in with_grads]
        norm = global_norm(weighted_square_sum([(local_tensor(p.grad), self.copies(p)) for p in with_grads]))
        coefficient = clip_coefficient(norm, max_norm)
        if coefficient < 1.0:
            torch._foreach_mul_([local_tensor(g) for g in grads], coefficient)
        return norm

    def build_optimizer(self, make_optimizer) -> torch.optim.Optimizer:
        """`make_optimizer(tensors)` builds the optimizer over the tensors this rank updates."""
        return make_optimizer(self.params)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def gradient_buffers(self) -> list[torch.Tensor]:
        """Gradient storage beyond `param.grad` (flat buckets, sharded gradients)."""
        return []

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank holds now for parameters, gradients and optimizer state (incl. masters)."""
        def size(tensors) -> int:
            return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)

        state = [v for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        masters = [p for group in optimizer.param_groups for p in group["params"]
                   if not any(p is q for q in self.params)]
        return {"params": size(self.params),
                "grads": size([p.grad for p in self.params if p.grad is not None] + self.gradient_buffers()),
                "optimizer": size(state) + size(masters)}


class ReplicatedDataParallel(DataParallel):
    """ZeRO-0: bucketed all-reduce of gradients, launched from gradient hooks during backward."""

    name = "zero 0: replicated parameters, bucketed gradient all-reduce"

    def __init__(self, parts, dims, group, expert_group=None):
        super().__init__(parts, dims)
        self.group, self.group_size = group, dist.get_world_size(group)
        self.buckets = self.reduction_buckets(1, group, None, expert_group, None)
        self._syncing = False
        self._next_bucket = 0
        self._handles: list = []
        for bucket in self.buckets:
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(self._make_hook(bucket))

    def _make_hook(self, bucket: Bucket):
        def hook(param):
            if self._syncing:
                settle_grad_layout(param)
                bucket.mark_ready(param)
                self._launch_ready_buckets()
        return hook

    def _launch_ready_buckets(self) -> None:
        # Launch strictly in bucket order so every rank issues the same collectives in the same order.
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].all_ready:
            bucket = self.buckets[self._next_bucket]
            bucket.pack_grads(scale=bucket.scale)
            self._handles.append(dist.all_reduce(bucket.buffer, group=bucket.group, async_op=True))
            self._next_bucket += 1

    def begin_micro_batch(self, is_last: bool) -> None:
        self._syncing = is_last  # the hooks of this micro-batch's backward reduce only if last

    def finish_grads(self) -> None:
        for bucket in self.buckets[self._next_bucket:]:
            # A pipeline's backward runs outside grad_sync, so no hook has settled these gradients:
            # sum a sequence-parallel norm weight's tp partials before it is packed and reduced.
            for param in bucket.params:
                settle_grad_layout(param)
            bucket.mark_all_ready()  # parameters that received no gradient still take part
        self._launch_ready_buckets()
        super().finish_grads()
        for handle in self._handles:
            handle.wait()
        for bucket in self.buckets:
            bucket.unpack_grads()
            bucket.reset()
            bucket.release()  # param.grad holds the reduced gradients; no second copy
        self._handles, self._next_bucket, self._syncing = [], 0, False


def build_data_parallel(parts: list[nn.Module], dims: ParallelDims, mesh, cfg: Config,
                        pipeline=None) -> DataParallel:
    if dims.dp * dims.cp == 1:
        if dims.expert_data_parallel > 1:
            # No data parallelism, but tp ranks holding the same experts (ep borrowing only part of
            # tp) saw different tokens: their expert gradients are partial sums to all-reduce.
            return ReplicatedDataParallel(parts, dims, mesh["dp_cp"].get_group(), mesh["edp"].get_group())
        return DataParallel(parts, dims)
    zero = cfg.parallel.zero
    if zero == 0:
        return ReplicatedDataParallel(parts, dims, mesh["dp_cp"].get_group(),
                                      mesh["edp"].get_group() if dims.ep > 1 else None)
    if zero in (1, 2):
        from fivefold.parallel.zero import ShardedOptimizerDataParallel

        return ShardedOptimizerDataParallel(parts, dims, mesh, shard_grads=zero == 2, pipeline=pipeline)
    from fivefold.parallel.fsdp import FullyShardedDataParallel
    from fivefold.plan.layout import SPLIT_BACKWARD_SCHEDULES

    # Schedules that split backward into an input pass and a later weight pass find the weights
    # through the stage's parameters when the input pass starts: blocks must still be unsharded then.
    split_backward = dims.pp > 1 and cfg.parallel.pp_schedule in SPLIT_BACKWARD_SCHEDULES
    return FullyShardedDataParallel(parts, dims, mesh, reshard_after_forward=not split_backward)
