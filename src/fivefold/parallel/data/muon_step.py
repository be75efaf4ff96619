"""Muon over ZeRO's flat master chunks (parallel/data/zero.py): each matrix orthogonalised whole,
once, on the one rank of its bucket's group that owns it, without changing the math.

A bucket holds Muon's matrices only (buckets never mix optimizer settings). Per bucket and step:
1. every rank has its chunk of the momentum update (train/muon.py: elementwise, like the whole);
2. the chunks are all-gathered: every rank sees the bucket's whole update;
3. each rank orthogonalises the matrices it owns (torch's Newton–Schulz) into a zero buffer;
4. the buffers are reduce-scattered: each rank receives its chunk of the orthogonalised update.
   Every element has exactly one non-zero addend, so the sum is exact.
Owners are chosen greedily, largest matrix first, to the least loaded rank by Newton–Schulz
flops, the same on every rank (`shares` says each rank's part). Zero 0 and dp = 1 under bf16
hold whole buckets: no collective, every matrix here. An expert's stacked tensor is one matrix per
expert.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fivefold.parallel.grad_norm import local_tensor
from fivefold.parallel.muon_matrices import newton_schulz, ns_flops, shares_note, whole_matrices

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ChunkMatrices:
    flat = True  # the optimizer's tensors are flat chunks, not matrices

    def __init__(self, buckets, chunks):
        self.buckets = {id(c): b for b, c in zip(buckets, chunks)}
        self.owned: dict[int, list] = {}  # id(chunk) -> (start, end, shape) in the bucket this rank orthogonalises
        self.shares = [0] * max([b.group_size for b in buckets] or [1])  # flops per rank of a group
        for bucket, chunk in zip(buckets, chunks):
            matrices = [(offset + s, offset + e, shape) for param, offset in zip(bucket.params, bucket.offsets)
                        for s, e, shape in whole_matrices(tuple(local_tensor(param).shape))]
            load, mine = [0] * bucket.group_size, []
            for matrix in sorted(matrices, key=lambda m: (-ns_flops(m[2]), m[0])):
                owner = min(range(bucket.group_size), key=lambda r: (load[r], r))
                load[owner] += ns_flops(matrix[2])
                if owner == bucket.group_rank:
                    mine.append(matrix)
            self.owned[id(chunk)] = mine
            self.shares = [a + b for a, b in zip(self.shares, load + [0] * (len(self.shares) - len(load)))]
            bucket.muon_matrices = matrices

    def describe(self, tensors=None) -> str:
        return shares_note("each matrix orthogonalised once, on one rank of its bucket's data-parallel group "
                           "(ZeRO chunks gathered)", self.shares)

    def matrices(self, chunk: torch.Tensor):
        """The matrices inside this chunk, clipped to it, with their whole shapes (for the lr)."""
        bucket = self.buckets[id(chunk)]
        lo = bucket.group_rank * chunk.numel()
        return [(max(s, lo) - lo, min(e, lo + chunk.numel()) - lo, shape)
                for s, e, shape in bucket.muon_matrices if s < lo + chunk.numel() and e > lo]

    def orthogonalize(self, chunk: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        bucket = self.buckets[id(chunk)]
        if bucket.group is None:
            whole = update
        else:
            whole = torch.empty(bucket.padded, dtype=update.dtype, device=update.device)
            _all_gather(whole, update.contiguous(), group=bucket.group)
        out = torch.zeros(bucket.padded, dtype=update.dtype, device=update.device)
        for start, end, shape in self.owned[id(chunk)]:
            out[start:end] = newton_schulz(whole[start:end].view(shape)).reshape(-1)
        if bucket.group is None:
            return out
        mine = torch.empty_like(update)
        _reduce_scatter(mine, out, group=bucket.group)
        return mine
