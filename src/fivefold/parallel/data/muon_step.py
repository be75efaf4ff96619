"""Muon over ZeRO's flat master chunks (parallel/data/zero.py): each matrix orthogonalised whole,
once, on the one rank that owns it, without changing the math.

A bucket holds Muon's matrices only (buckets never mix optimizer settings). Per bucket and step:
1. every rank has its chunk of the momentum update (train/muon.py: elementwise, like the whole);
2. the chunks are all-gathered over the bucket's data-parallel group: every rank sees the bucket's
   whole update, which under tensor parallelism is this rank's tp shard of each matrix;
3. whole matrices: each rank orthogonalises those it owns into a zero buffer. Tensor-parallel ones
   (DTensors): each is gathered over its tp mesh too (`full_tensor`), its owner (one data-parallel
   rank and one tp rank) orthogonalises it, and a sum over the tp mesh hands each tp rank its shard
   of the result (zeros in every other data-parallel rank's buffer);
4. the buffers are reduce-scattered: each rank receives its chunk of the orthogonalised update.
   Every element has exactly one non-zero addend, so the sums are exact.
A window of as many buckets as they have owners (the group's ranks, times the tp ranks of the
DTensors in them) goes through each step together (all gathered, then each owner's matrices
orthogonalised, then all reduced), so the owners work at once instead of each bucket's
reduce-scatter waiting for its owner (a bucket holds one matrix of a large model).
The window's whole buckets are held at once.
Owners are chosen greedily, largest matrix first, to the least loaded rank by Newton–Schulz
flops, the same on every rank (`shares` says each rank's part). Zero 0 and dp = 1 under bf16
hold whole buckets: no data-parallel collective. An expert's stacked tensor is one matrix per
expert.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch.distributed.tensor import DTensor

from fivefold.parallel.muon_dtensor import DTensorMatrices, gather_whole, owned_result, shard_of_sum
from fivefold.parallel.muon_matrices import newton_schulz, ns_flops, shares_note, whole_matrices

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ChunkMatrices:
    flat = True  # the optimizer's tensors are flat chunks, not matrices

    def __init__(self, buckets, chunks):
        self.buckets = {id(c): b for b, c in zip(buckets, chunks)}
        self.owned: dict[int, list] = {}  # id(chunk) -> (start, end, shape) of whole matrices this rank orthogonalises
        self.sharded: dict[int, list] = {}  # id(chunk) -> (param, offset, size, owned here) of its DTensors
        plain_load: dict[int, int] = {}  # data-parallel rank -> flops of whole matrices
        sharded_load: dict[tuple, int] = {}  # (data-parallel rank, index in the tp mesh) -> flops
        for bucket, chunk in zip(buckets, chunks):
            whole, sharded = [], []
            for param, offset, size in zip(bucket.params, bucket.offsets, bucket.sizes):
                if isinstance(param, DTensor):
                    sharded.append((param, offset, size))
                else:
                    whole += [(offset + s, offset + e, shape) for s, e, shape in whole_matrices(tuple(param.shape))]
            mine = []
            for matrix in sorted(whole, key=lambda m: (-ns_flops(m[2]), m[0])):
                owner = min(range(bucket.group_size), key=lambda r: (plain_load.get(r, 0), r))
                plain_load[owner] = plain_load.get(owner, 0) + ns_flops(matrix[2])
                if owner == bucket.group_rank:
                    mine.append(matrix)
            self.owned[id(chunk)] = mine
            self.sharded[id(chunk)] = self._sharded_owners(bucket, sharded, sharded_load)
            bucket.muon_matrices = whole + [(offset + s, offset + e, shape) for param, offset, _ in sharded
                                            for s, e, shape in DTensorMatrices.local_matrices(param)]
        # A window of as many chunks as a bucket has owners (its group's ranks, times its DTensors'
        # tp ranks): consecutive buckets' owners differ, and a bucket holding one tp-split matrix
        # (a large model's) leaves no owner idle, with dp = 1 too.
        self.window = max([b.group_size * self._tp_ranks(b) for b in buckets] or [1])
        plain = [plain_load.get(r, 0) for r in range(max([b.group_size for b in buckets] or [1]))]
        self.shares = ([flops + plain[g] for (g, _), flops in sorted(sharded_load.items())] if sharded_load
                       else plain)

    @staticmethod
    def _tp_ranks(bucket) -> int:
        return max([p.device_mesh.mesh.numel() for p in bucket.params if isinstance(p, DTensor)] or [1])

    @staticmethod
    def _sharded_owners(bucket, sharded, load: dict) -> list:
        """(param, offset, size, owned here) for the bucket's DTensors, in bucket order: each
        tensor's owner is the least-loaded (data-parallel rank, tp mesh index), largest first."""
        owners = {}
        for param, offset, _ in sorted(sharded, key=lambda t: (-DTensorMatrices.flops(t[0]), t[1])):
            ranks = param.device_mesh.mesh.flatten().tolist()
            slots = [(g, j) for g in range(bucket.group_size) for j in range(len(ranks))]
            owner = min(slots, key=lambda slot: (load.get(slot, 0), slot))
            load[owner] = load.get(owner, 0) + DTensorMatrices.flops(param)
            owners[offset] = owner == (bucket.group_rank, ranks.index(dist.get_rank()))
        return [(param, offset, size, owners[offset]) for param, offset, size in sharded]

    def describe(self, tensors=None) -> str:
        gathered = "ZeRO chunks and tensor-parallel shards" if any(self.sharded.values()) else "ZeRO chunks"
        return shares_note("each matrix orthogonalised once, on one rank of its bucket's data-parallel group "
                           f"({gathered} gathered)", self.shares)

    def matrices(self, chunk: torch.Tensor):
        """The matrices inside this chunk, clipped to it, with their whole shapes (for the lr)."""
        bucket = self.buckets[id(chunk)]
        lo = bucket.group_rank * chunk.numel()
        return [(max(s, lo) - lo, min(e, lo + chunk.numel()) - lo, shape)
                for s, e, shape in bucket.muon_matrices if s < lo + chunk.numel() and e > lo]

    def orthogonalize(self, chunks: list[torch.Tensor], updates: list[torch.Tensor],
                      ns_dtype: str = "bf16") -> list[torch.Tensor]:
        """A window's chunks in three passes, so that their owners work at the same time: every
        bucket (and tensor-parallel matrix) gathered, each owner's orthogonalised, every result
        summed back (over tp, then reduce-scattered over the bucket's group)."""
        buckets = [self.buckets[id(c)] for c in chunks]
        wholes = [self._gathered(b, u) for b, u in zip(buckets, updates)]
        sharded = [[(param, offset, size, owned, gather_whole(param, whole[offset:offset + size].view(param.to_local().shape)))
                    for param, offset, size, owned in self.sharded[id(c)]] for c, whole in zip(chunks, wholes)]
        outs, tp_results = [], []
        for chunk, bucket, whole, tensors in zip(chunks, buckets, wholes, sharded):
            out = torch.zeros(bucket.padded, dtype=whole.dtype, device=whole.device)
            for start, end, shape in self.owned[id(chunk)]:
                out[start:end] = newton_schulz(whole[start:end].view(shape), ns_dtype).reshape(-1)
            outs.append(out)
            tp_results.append([(param, offset, size, owned_result(full, owned, ns_dtype)) for param, offset, size, owned, full in tensors])
        mine = []
        for bucket, update, out, results in zip(buckets, updates, outs, tp_results):
            for param, offset, size, result in results:
                out[offset:offset + size] = shard_of_sum(param, result).reshape(-1)
            if bucket.group is None:
                mine.append(out)
                continue
            piece = torch.empty_like(update)
            _reduce_scatter(piece, out, group=bucket.group)
            mine.append(piece)
        return mine

    @staticmethod
    def _gathered(bucket, update: torch.Tensor) -> torch.Tensor:
        if bucket.group is None:
            return update
        whole = torch.empty(bucket.padded, dtype=update.dtype, device=update.device)
        _all_gather(whole, update.contiguous(), group=bucket.group)
        return whole
