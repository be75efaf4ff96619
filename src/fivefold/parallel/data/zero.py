"""ZeRO-1 and ZeRO-2 (ours): optimizer state, and at stage 2 gradients, sharded over dp.

Parameters are grouped into flat buckets (parallel/data/buckets.py); rank s of the dp_shard group owns
the s-th equal chunk of every bucket. It keeps an fp32 master copy of that chunk and the AdamW
state for it. A step: reduce-scatter each bucket's gradients (each rank receives the summed
gradient of its chunk), AdamW on the chunks, all-gather the updated chunks into the parameters.
AdamW's weight decay is uniform (train/optim.py), so the update is elementwise and a chunk that
cuts through a tensor gets exactly the update the whole tensor would.

- zero 1: gradients stay whole in `param.grad` over the micro-batches and are reduced once.
- zero 2: each micro-batch's gradients are reduce-scattered as soon as a bucket is complete and
  accumulated into the chunk; whole gradients never outlive their bucket.
  Under a pipeline the schedule runs the backward, not grad_sync: each stage's buckets are
  reduce-scattered after every action that completes a micro-batch's weight gradients of that
  stage (Pipeline.on_weight_grads), so there too whole gradients never outlive one micro-batch.
  Buckets then hold one stage's parameters each, and a tied embedding copy a bucket of its own:
  its chunk is the same slice of the matrix on every stage, so the copies' chunk gradients add.
HSDP: chunks are owned within a dp_shard group; groups then all-reduce their chunk gradients.

bf16 (`train.dtype = bf16`, the anchors' recipe: Megatron's distributed optimizer): the model's
parameters are bf16, and this class keeps the fp32 master weights (the chunks) and AdamW's state.
- Each micro-batch's bf16 gradients are added into the fp32 bucket buffers as backward produces
  them (`main_grads`), so accumulation over micro-batches is fp32; the buffers are reduced once,
  in fp32, and each rank's chunk of the reduced buffer is its master chunk's gradient (a view: no
  second copy). Per parameter: 2 (bf16 weight) + 4 (fp32 gradient buffer) + 12/dp (master and
  moments). Zero 2 keeps reducing each micro-batch: 2 + 16/dp.
- Zero 0 and a layout without data parallelism run here too, with whole buckets as "chunks"
  (`shard = False`): every rank keeps every master, and the buffers are all-reduced instead.
- After the update the chunks are cast to bf16 and all-gathered into the parameters (half the
  bytes of an fp32 gather).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fivefold.parallel.data.base import DataParallel, local_row_factor, trainable, weak_pair
from fivefold.parallel.gloo import reduce_scatter_via_all_to_all
from fivefold.parallel.grad_norm import (
    clip_coefficient,
    global_norm,
    local_tensor,
    settle_grad_layout,
    weighted_square_sum,
)

# torch 2.13 renamed the single-tensor collectives; keep working on 2.11/2.12.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardedOptimizerDataParallel(DataParallel):
    def __init__(self, parts, dims, mesh, shard_grads: bool, pipeline=None, main_grads: bool = False,
                 shard: bool = True, settings: dict | None = None):
        """main_grads: bf16 parameters, whose gradients accumulate in the fp32 bucket buffers.
        shard: False keeps whole masters on every rank and all-reduces (bf16 at zero 0 or dp = 1).
        settings: each parameter's optimizer settings by name (config/param_groups.py). A bucket
        holds parameters of one settings only, so each chunk is one optimizer tensor of one
        parameter group, whatever tensors it cuts through; the cost is a few more, smaller
        buckets (norms, biases and embeddings apart from the matrices)."""
        super().__init__(parts, dims)
        self.set_settings(settings)
        self.shard_grads, self.main_grads = shard_grads, main_grads
        if shard:
            self.name = (f"zero {2 if shard_grads else 1}: optimizer state{' and gradients' if shard_grads else ''} "
                         f"sharded over {dims.dp_shard * dims.cp} ranks"
                         + (f", replicated x{dims.dp_replicate}" if dims.dp_replicate > 1 else ""))
            # cp ranks hold the same weights as their dp peers: they share the shards too.
            self.shard_group = mesh["dp_shard_cp"].get_group()
            self.replicate_group = mesh["dp_replicate"].get_group() if dims.dp_replicate > 1 else None
            # Expert parameters are sharded over the ranks holding the same experts (parallel/expert/apply.py).
            expert_mesh = mesh["edp"] if dims.ep > 1 else None
            groups = (self.shard_group, mesh["dp_shard_cp"].get_local_rank(), expert_mesh and expert_mesh.get_group(),
                      expert_mesh and expert_mesh.get_local_rank())
            expert_replicas = None
        else:
            self.name = ("zero 0: replicated parameters and fp32 masters, bucketed gradient all-reduce"
                         if dims.dp * dims.cp > 1 else "no data parallelism")
            self.shard_group = None
            self.replicate_group = mesh["dp_cp"].get_group() if dims.dp * dims.cp > 1 else None
            expert_replicas = mesh["edp"].get_group() if dims.ep > 1 and dims.expert_data_parallel > 1 else None
            groups = (None, 0, None, 0)
        if main_grads:
            self.name += "; bf16 weights, fp32 gradient accumulation and master weights"
        self.per_stage = shard_grads and pipeline is not None
        self.tied = pipeline.tied_copies() if pipeline is not None and (self.per_stage or main_grads) else []
        if self.per_stage:
            self.buckets, self._stage_buckets, seen = [], [], set()
            tied_ids = {id(t) for t in self.tied}
            for part in parts:  # a stage's buckets, then each tied copy of it alone
                own = [p for p in trainable([part]) if id(p) not in seen]
                seen.update(id(p) for p in own)
                first = len(self.buckets)
                rest = [p for p in own if id(p) not in tied_ids]
                for params in [rest] + [[p] for p in own if id(p) in tied_ids]:
                    if params:
                        self.buckets += self.reduction_buckets(None, *groups, params=params)
                self._stage_buckets.append(range(first, len(self.buckets)))
            pipeline.on_weight_grads = self.reduce_stage
        else:
            self.buckets = self.reduction_buckets(None, *groups)
        for bucket in self.buckets:  # who adds up whole chunks after the shard group's reduction
            bucket.replicate_group = expert_replicas if bucket.is_expert else self.replicate_group
        self.chunks = [nn.Parameter(b.pack_chunk()) for b in self.buckets]
        if main_grads and pipeline is not None and not self.per_stage:
            # Split backward schedules write weight gradients without the accumulation hooks:
            # move each finished micro-batch's bf16 gradients into the fp32 buffers at once.
            stage_params = [trainable([part]) for part in parts]
            pipeline.on_weight_grads = lambda stage: self._absorb(stage_params[stage])
        self._views = None  # main_grads: id(param) -> its view of the buffers, built at first use
        self._step_open = False  # main_grads: the buffers hold this step's sums (zeroed at its first)
        self._segments = None  # built at the first clip: extra_copies may be set after construction
        self._syncing, self._next_bucket, self._pending = False, 0, []
        self._reduced_in_micro_batches = False
        for bucket in self.buckets:
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(self._make_hook(bucket))

    def _norm_segments(self, bucket) -> list[tuple[int, int, int]]:
        """(start, end, copies) of each parameter's part inside this rank's chunk of `bucket`."""
        chunk = bucket.padded // bucket.group_size
        lo, hi = bucket.group_rank * chunk, (bucket.group_rank + 1) * chunk
        segments = []
        for param, offset, size in zip(bucket.params, bucket.offsets, bucket.sizes):
            start, end = max(lo, offset), min(hi, offset + size)
            if start < end:
                copies = self.copies(param) // bucket.group_size
                segments.append((start - lo, end - lo, copies))
        return segments

    def _make_hook(self, bucket):
        owner, bucket_ref = weak_pair(self, bucket)

        def hook(param):
            me, bucket = owner(), bucket_ref()
            if me is None:
                return
            if me.main_grads:
                me._absorb([param])
            if me._syncing:
                settle_grad_layout(param)
                bucket.mark_ready(param)
                me._launch_ready_buckets()
        return hook

    def _absorb(self, params) -> None:
        """main_grads: add the parameters' bf16 gradients into their fp32 buffer views."""
        if not self._step_open:
            for bucket in self.buckets:
                bucket.buffer.zero_()
            self._step_open = True
        for param in params:
            if param.grad is None:
                continue
            settle_grad_layout(param)
            self._grad_view(param).add_(local_tensor(param.grad).reshape(-1))
            param.grad = None

    def _grad_view(self, param) -> torch.Tensor:
        """The flat fp32 buffer view that accumulates `param`'s gradient (main_grads)."""
        if self._views is None:
            self._views = {id(p): view for b in self.buckets for p, view in b.views(b.buffer)}
        return self._views[id(param)]

    def _launch(self, index: int) -> None:
        bucket, chunk = self.buckets[index], self.chunks[index]
        if self.main_grads:
            self._absorb(bucket.params)  # whatever arrived outside the hooks (a pipeline's backward)
            bucket.buffer.mul_(bucket.scale)
        else:
            bucket.pack_grads(scale=bucket.scale)
            for param in bucket.params:
                param.grad = None  # the bucket holds these gradients now
        if bucket.group is None:  # whole masters on every rank: all-reduce the buffer in place
            handle = (dist.all_reduce(bucket.buffer, group=bucket.replicate_group, async_op=True)
                      if bucket.replicate_group is not None else None)
            self._pending.append((index, bucket.buffer, handle))
            return
        if reduce_scatter_via_all_to_all(bucket.group):
            # Every rank's copy of this rank's chunk, summed when it arrives; the receive
            # buffer is a whole bucket for as long as the collective is in flight.
            received = torch.empty_like(bucket.buffer)
            handle = dist.all_to_all_single(received, bucket.buffer, group=bucket.group, async_op=True)
        else:
            received = torch.empty_like(chunk)
            handle = _reduce_scatter(received, bucket.buffer, group=bucket.group, async_op=True)
        self._pending.append((index, received, handle))

    def _launch_ready_buckets(self) -> None:
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].all_ready:
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def reduce_stage(self, stage: int) -> None:
        """ZeRO-2 under a pipeline: this micro-batch's gradients of pipeline part `stage` into the
        chunks. Every dp peer runs the same schedule, so the collectives meet in the same order.
        Waiting at once keeps one stage's whole gradients alive, never more (no overlap with the
        next action: simpler, and the pipeline's own sends already overlap with compute)."""
        for index in self._stage_buckets[stage]:
            for param in self.buckets[index].params:
                settle_grad_layout(param)  # e.g. a sequence-parallel norm weight's tp partials
            self._launch(index)
        self._complete_pending()
        self._reduced_in_micro_batches = True

    def sum_tied(self, pipeline, group) -> None:
        if self.main_grads:  # the copies' gradients are in the fp32 buffers
            self._absorb(self.params)
            views = [self._grad_view(t) for t in self.tied]
            if views:
                total = torch.stack(views).sum(0)
                if group is not None:
                    dist.all_reduce(total, group=group)
                for view in views:
                    view.copy_(total)
            return
        if not self.per_stage:
            return super().sum_tied(pipeline, group)
        # The copies' gradients are already chunks; a copy's bucket holds it alone, so this rank's
        # chunk is the same slice of the matrix on every stage holding a copy.
        chunks = [self.chunks[i] for i, b in enumerate(self.buckets)
                  if len(b.params) == 1 and any(b.params[0] is t for t in self.tied)]
        grads = [c.grad for c in chunks if c.grad is not None]
        if not grads:
            return
        total = torch.stack(grads).sum(0)
        if group is not None:
            dist.all_reduce(total, group=group)
        for grad in grads:
            grad.copy_(total)

    def _complete_pending(self) -> None:
        for index, received, handle in self._pending:
            if handle is not None:
                handle.wait()
            chunk, bucket = self.chunks[index], self.buckets[index]
            if received.numel() != chunk.numel() and bucket.group is not None:  # the all-to-all's pieces
                received = received.view(-1, chunk.numel()).sum(0)
            if self.main_grads:  # this rank's chunk of the buffer is the master's gradient
                own = bucket.buffer[bucket.group_rank * chunk.numel():(bucket.group_rank + 1) * chunk.numel()]
                if received is not own:
                    own.copy_(received)
                chunk.grad = own
                continue
            chunk.grad = received if chunk.grad is None else chunk.grad.add_(received)
            if self.shard_grads:
                self.buckets[index].release()  # whole gradients never outlive their bucket
        for bucket in self.buckets:
            bucket.reset()
        self._pending, self._next_bucket = [], 0

    def begin_micro_batch(self, is_last: bool) -> None:
        # zero 2 reduces every micro-batch; zero 1 only the last one's accumulated gradients.
        self._syncing = self.shard_grads or is_last

    def end_micro_batch(self) -> None:
        if self.shard_grads:
            self._flush()
            self._reduced_in_micro_batches = True

    def _flush(self) -> None:
        for bucket in self.buckets[self._next_bucket:]:
            # A pipeline's backward runs outside grad_sync, so no hook has settled these gradients:
            # sum a sequence-parallel norm weight's tp partials before it is packed and reduced.
            for param in bucket.params:
                settle_grad_layout(param)
            bucket.mark_all_ready()
        self._launch_ready_buckets()
        self._complete_pending()

    def finish_grads(self) -> None:
        if not self._reduced_in_micro_batches:  # zero 2 reduces each micro-batch as it ends
            self._flush()
        elif self.per_stage and any(p.grad is not None for p in self.params):
            raise RuntimeError("zero 2 under a pipeline: a gradient arrived outside the stages' "
                               "backward actions and would be lost")
        self._reduced_in_micro_batches = False
        # HSDP: dense chunks are owned within a dp_shard group, so the replicas add theirs up;
        # expert chunks are owned across the whole expert-data-parallel group, replicas included.
        # (Whole masters were all-reduced by their bucket's launch.)
        for bucket, chunk in zip(self.buckets, self.chunks):
            if bucket.replicate_group is not None and bucket.group is not None:
                dist.all_reduce(chunk.grad, group=bucket.replicate_group)
        self._syncing, self._step_open = False, False

    def clip_grad_norm(self, max_norm: float) -> float:
        if self._segments is None:
            self._segments = [self._norm_segments(b) for b in self.buckets]
        pieces = [(chunk.grad[start:end], copies) for chunk, segments in zip(self.chunks, self._segments)
                  for start, end, copies in segments]
        norm = global_norm(weighted_square_sum(pieces))
        coefficient = clip_coefficient(norm, max_norm)
        if coefficient < 1.0:
            torch._foreach_mul_([c.grad for c in self.chunks], coefficient)
        return norm

    def gradient_buffers(self) -> list[torch.Tensor]:
        live_buckets = [b.buffer for b in self.buckets if b.allocated]
        return live_buckets + [c.grad for c in self.chunks if c.grad is not None]

    def build_optimizer(self, make_optimizer) -> torch.optim.Optimizer:
        return make_optimizer(self.chunks)  # the optimizer sees only this rank's chunks

    def muon_layout(self):
        """How Muon finds whole matrices in this rank's chunks (parallel/data/muon_step.py)."""
        from fivefold.parallel.data.muon_step import ChunkMatrices

        muon = [(b, c) for b, c in zip(self.buckets, self.chunks) if getattr(self.settings_of(c), "optimizer", "") == "muon"]
        return ChunkMatrices([b for b, _ in muon], [c for _, c in muon])

    def settings_of(self, tensor: torch.Tensor):
        for bucket, chunk in zip(self.buckets, self.chunks):
            if chunk is tensor:
                return super().settings_of(bucket.params[0])  # a bucket holds one settings
        return super().settings_of(tensor)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        self.write_params()

    @torch.no_grad()
    def scale_rows(self, row_scales: dict) -> None:
        """As DataParallel.scale_rows, in the master chunks (each chunk takes the factors of the
        elements it holds), then the parameters written from them again."""
        for bucket, chunk in zip(self.buckets, self.chunks):
            lo = bucket.group_rank * chunk.numel() if bucket.group is not None else 0
            for param, offset, size in zip(bucket.params, bucket.offsets, bucket.sizes):
                start, end = max(offset, lo), min(offset + size, lo + chunk.numel())
                if param not in row_scales or start >= end:
                    continue
                factor = local_row_factor(param, row_scales[param]).reshape(-1)
                chunk.data[start - lo:end - lo].mul_(factor[start - offset:end - offset])
        self.write_params()

    def write_params(self) -> None:
        """The parameters from the master chunks: all-gathered in the parameters' dtype (bf16
        weights gather half the bytes of their fp32 masters). Collective over each bucket's group."""
        for bucket, chunk in zip(self.buckets, self.chunks):
            if bucket.group is None:
                bucket.unpack_params(chunk.detach())
                continue
            dtype = local_tensor(bucket.params[0]).dtype
            gathered = torch.empty(bucket.padded, dtype=dtype, device=chunk.device)
            _all_gather(gathered, chunk.detach().to(dtype), group=bucket.group)
            bucket.unpack_params(gathered)

    def master_weights(self) -> dict[int, torch.Tensor]:
        """id(param) -> the fp32 master of this rank's local piece (a collective: the chunks are
        all-gathered in fp32)."""
        out = {}
        for bucket, chunk in zip(self.buckets, self.chunks):
            flat = chunk.detach()
            if bucket.group is not None:
                flat = torch.empty(bucket.padded, dtype=chunk.dtype, device=chunk.device)
                _all_gather(flat, chunk.detach(), group=bucket.group)
            for param, view in bucket.views(flat):
                out[id(param)] = view.view(local_tensor(param).shape)
        return out
