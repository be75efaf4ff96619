"""ZeRO 0 (ours): every rank keeps everything; gradients are all-reduced in buckets that start while
the backward pass is still running (DDP cannot hold tensor-parallel DTensor parameters)."""

from __future__ import annotations

import torch.distributed as dist

from fivefold.parallel.data.base import DataParallel, weak_pair
from fivefold.parallel.data.buckets import Bucket
from fivefold.parallel.grad_norm import settle_grad_layout


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
        owner, bucket_ref = weak_pair(self, bucket)

        def hook(param):
            me, bucket = owner(), bucket_ref()
            if me is not None and me._syncing:
                settle_grad_layout(param)
                bucket.mark_ready(param)
                me._launch_ready_buckets()
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
