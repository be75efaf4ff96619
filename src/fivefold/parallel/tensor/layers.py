"""Tensor-parallel layers (blocks, vocab-parallel embedding and output) computing on plain local tensors.

The weights are DTensors, so FSDP2, sharded checkpoints, the gradient norm and the optimizer see
their layout; but forward and backward run on the local shards, with one explicit
collective at each boundary of the tensor-parallel region (Megatron's layout). Letting DTensor
propagate shardings through every operator instead cost a tp=2 CPU rank 67 ms per step, and the
rank ran 1.18x slower (benchmarks/RESULTS.md, run F).

The collectives are PyTorch's functional ones (`_c10d_functional`, the ops DTensor itself issues):
they carry their own autograd (an all-gather's backward is a reduce-scatter and vice versa), torch
.compile traces them, and the communication ledger sees them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from fivefold.models.loss.linear_cross_entropy import linear_cross_entropy
from fivefold.models.rms_norm import rms_norm
from fivefold.parallel.gloo import reduce_scatter_via_all_to_all
from fivefold.parallel.tensor.sharded_inputs import mark, saving_shards
from fivefold.parallel.stream_projection import project
from fivefold.parallel.vocab_shard import VocabShard
from fivefold.torch_internals import c10d_functional as _c10d


class TensorParallelGroup:
    """The tp ranks of this rank and how the residual stream between blocks is laid out over them:
    split along the sequence (sequence parallel: (batch, seq/tp, dim) on each rank) or whole."""

    def __init__(self, tp_mesh, sequence_parallel: bool, keep_shards: bool = False):
        self.mesh = tp_mesh
        self.size = tp_mesh.size()
        self.name = tp_mesh.get_group().group_name
        self.sequence_parallel = sequence_parallel
        # Layers reading a gathered sequence save its shard and gather it again in backward
        # (parallel/tensor/sharded_inputs.py); sequence parallelism without recomputation only.
        self.keep_shards = keep_shards and sequence_parallel
        self.scatter_by_all_to_all = reduce_scatter_via_all_to_all(tp_mesh.get_group())

    # The collectives, along dim 0 (the layout NCCL and gloo gather and scatter without copies),
    # on values without autograd; the autograd functions below pair them up.
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return _c10d.wait_tensor(_c10d.all_gather_into_tensor(x.contiguous(), self.size, self.name))

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        if self.scatter_by_all_to_all:  # each rank sends chunk r to rank r and sums what it gets
            splits = [x.shape[0] // self.size] * self.size
            received = _c10d.wait_tensor(_c10d.all_to_all_single(x.contiguous(), splits, splits, self.name))
            return received.view(self.size, -1, *x.shape[1:]).sum(0)
        return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(x.contiguous(), "sum", self.size, self.name))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), "sum", self.name))

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """Stream -> the whole sequence (batch, seq, dim), in order: attention needs positions."""
        if not self.sequence_parallel:
            return _SumGradients.apply(x, self)
        whole = self._in_sequence_order(_GatherChunks.apply(x, self), x.shape)
        return mark(whole, x, self._sequence_of) if self.keep_shards else whole

    def _in_sequence_order(self, gathered: torch.Tensor, shape) -> torch.Tensor:
        batch, local, dim = shape  # gathered: (tp·batch, seq/tp, dim), rank-major
        if batch == 1:
            return gathered.view(1, self.size * local, dim)
        return gathered.view(self.size, batch, local, dim).transpose(0, 1).reshape(batch, -1, dim)

    def _sequence_of(self, shard: torch.Tensor) -> torch.Tensor:
        return self._in_sequence_order(self.all_gather(shard), shard.shape)

    def scatter_sequence(self, partial: torch.Tensor) -> torch.Tensor:
        """Per-rank partial sums (batch, seq, dim) -> their sum, in the stream's layout."""
        if not self.sequence_parallel:
            return _SumValues.apply(partial, self)
        batch, seq, dim = partial.shape
        local = seq // self.size
        rank_major = partial.view(batch, self.size, local, dim).transpose(0, 1).reshape(-1, local, dim)
        return _ScatterSums.apply(rank_major, self)

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Stream -> every token of the tp group, in any order: for per-token layers (the MLP), which
        thereby skip the re-ordering copies of `gather_sequence` in both directions."""
        if not self.sequence_parallel:
            return _SumGradients.apply(x, self)
        gathered = _GatherChunks.apply(x, self)
        return mark(gathered, x, self.all_gather) if self.keep_shards else gathered

    def scatter_tokens(self, partial: torch.Tensor) -> torch.Tensor:
        """The inverse of `gather_tokens` for per-rank partial sums."""
        return _ScatterSums.apply(partial, self) if self.sequence_parallel else _SumValues.apply(partial, self)


class _GatherChunks(torch.autograd.Function):
    """All-gather along dim 0; backward: reduce-scatter (each rank's share of every chunk's gradient)."""

    @staticmethod
    def forward(ctx, x, group: TensorParallelGroup):
        ctx.group = group
        return group.all_gather(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.reduce_scatter(grad), None


class _ScatterSums(torch.autograd.Function):
    """Reduce-scatter along dim 0; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group: TensorParallelGroup):
        ctx.group = group
        return group.reduce_scatter(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_gather(grad), None


class _SumGradients(torch.autograd.Function):
    """Identity forward, all-reduce backward: where a whole stream enters column-split layers
    (Megatron's f), each rank's gradient covers only its columns' share."""

    @staticmethod
    def forward(ctx, x, group: TensorParallelGroup):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_reduce(grad), None


class _SumValues(torch.autograd.Function):
    """All-reduce forward, identity backward: the sum of row-split layers' partial outputs
    (Megatron's g); the gradient of the sum is already whole on every rank."""

    @staticmethod
    def forward(ctx, x, group: TensorParallelGroup):
        return group.all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _laid_out(layer: nn.Module, group: TensorParallelGroup, placement, name: str = "weight") -> nn.Parameter:
    """`layer`'s weight (or other tensor) as a DTensor over the tp ranks; every rank holds the whole
    tensor already (initialisation is seeded per name), so each keeps its slice without communicating."""
    return nn.Parameter(distribute_tensor(getattr(layer, name).detach(), group.mesh, [placement], src_data_rank=None))


def _laid_out_bias(layer: nn.Module, group: TensorParallelGroup, placement) -> nn.Parameter | None:
    """An nn.Linear's bias laid out like its output (None when it has none)."""
    return _laid_out(layer, group, placement, "bias") if getattr(layer, "bias", None) is not None else None


def _no_bias(layer: nn.Module) -> None:
    if getattr(layer, "bias", None) is not None:
        raise ValueError(f"a tensor-parallel {type(layer).__name__} carries no bias, and this one has one")


def _local(weight: torch.Tensor, **kwargs) -> torch.Tensor:
    # Under FSDP2 + tp the gathered weight is a DTensor over the tp mesh, as it is without FSDP2.
    return weight.to_local(**kwargs)


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ (+ b) for this rank's rows of W and b (its output columns: heads, hidden units)."""

    # The matmul dimension the tp ranks split; train.fp8 swaps `matmul` for an FP8 one whose scales
    # span it (parallel/float8.py).
    sharded_dim = "out"

    def __init__(self, linear: nn.Linear, group: TensorParallelGroup):
        super().__init__()
        self.weight = _laid_out(linear, group, Shard(0))
        self.bias = _laid_out_bias(linear, group, Shard(0))
        self.matmul = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with saving_shards(x):
            return self.matmul(x, _local(self.weight), _local(self.bias) if self.bias is not None else None)


class RowParallelLinear(nn.Module):
    """This rank's input columns times its columns of W, then `reduce` sums over the tp ranks; a
    bias (replicated) is added once, to the sum. Under sequence parallelism each rank adds it to its
    own tokens, so its gradient is a partial sum; on a whole, replicated stream it is whole."""

    sharded_dim = "in"  # as ColumnParallelLinear's

    def __init__(self, linear: nn.Linear, group: TensorParallelGroup, reduce):
        super().__init__()
        self.weight = _laid_out(linear, group, Shard(1))
        self.bias = _laid_out_bias(linear, group, Replicate())
        self.reduce = reduce
        self.bias_grad = [Partial()] if group.sequence_parallel else [Replicate()]
        # An operator of its own: recomputation must keep its input, not its output (whole-sequence
        # partial sums under sequence parallelism; parallel/stream_projection.py).
        self.matmul = project

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.reduce(self.matmul(x, _local(self.weight)))
        return out if self.bias is None else out + _local(self.bias, grad_placements=self.bias_grad).to(out.dtype)


class PartialGradLinear(nn.Module):
    """y = x Wᵀ with W replicated on every tp rank. Used where the output feeds column-split layers
    (a latent down-projection): each rank's gradient of W covers only its own columns' share, a
    partial sum (summed over tp where the gradient is settled)."""

    def __init__(self, linear: nn.Linear, group: TensorParallelGroup):
        super().__init__()
        self.weight = _laid_out(linear, group, Replicate())
        self.bias = _laid_out_bias(linear, group, Replicate())  # a router's (gpt-oss): partial too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = _local(self.bias, grad_placements=[Partial()]) if self.bias is not None else None
        with saving_shards(x):
            return F.linear(x, _local(self.weight, grad_placements=[Partial()]), bias)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the vocabulary. Tokens outside them look up zeros; `reduce` sums the
    ranks' lookups into the stream's layout, so each token gets exactly its own row."""

    def __init__(self, embedding: nn.Embedding, group: TensorParallelGroup, reduce):
        super().__init__()
        self.weight = _laid_out(embedding, group, Shard(0))
        self.first_row = group.mesh.get_local_rank() * (embedding.num_embeddings // group.size)
        self.reduce = reduce

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = _local(self.weight)
        ids = tokens - self.first_row
        elsewhere = (ids < 0) | (ids >= rows.shape[0])
        looked_up = F.embedding(ids.masked_fill(elsewhere, 0), rows)
        return self.reduce(looked_up.masked_fill(elsewhere.unsqueeze(-1), 0))


class VocabParallelOutput(ColumnParallelLinear):
    """Logits of this rank's vocabulary columns for the whole sequence, as a DTensor sharded on the
    vocabulary: the loss (`loss_parallel`) never gathers them. With `targets` (models/
    linear_cross_entropy.py OutputLayer), the summed cross-entropy instead, from this rank's
    columns without their logits (Megatron's vocabulary-parallel loss, fused with the layer): one
    max and one sum of a few floats per token over the tp ranks, and the input's gradient summed
    over them as any column-split layer's."""

    def __init__(self, linear: nn.Linear, group: TensorParallelGroup):
        _no_bias(linear)
        super().__init__(linear, group)
        self.group = group
        self.vocab_shard = VocabShard(group.mesh.get_local_rank() * (linear.out_features // group.size), group.name)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        whole = self.group.gather_sequence(x)
        if targets is not None:
            with saving_shards(whole):
                return linear_cross_entropy(whole, _local(self.weight), targets, shard=self.vocab_shard)
        logits = super().forward(whole)
        return DTensor.from_local(logits, self.group.mesh, [Shard(-1)], run_check=False)


class PartialRMSNorm(nn.Module):
    """RMSNorm of this rank's share of the rows it normalises: its part of the sequence (a norm on
    the stream under sequence parallelism) or its heads (a per-head q/k norm). The weight is
    replicated; its gradient from a share of the rows is a partial sum (summed over tp where the
    gradient is settled)."""

    def __init__(self, norm: nn.Module, group: TensorParallelGroup):
        super().__init__()
        self.normalized_shape, self.eps = norm.normalized_shape, norm.eps
        self.weight = _laid_out(norm, group, Replicate())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, _local(self.weight, grad_placements=[Partial()]), self.eps)


class HeadSplitValues(nn.Module):
    """A module of one value per attention head (models/decoder.py HeadValues: the sinks' logits),
    split by heads as the column-split q is; returns this rank's heads. Each rank attends with its
    heads over the whole sequence, so their gradients are whole."""

    def __init__(self, values: nn.Module, group: TensorParallelGroup):
        super().__init__()
        self.weight = _laid_out(values, group, Shard(0))

    def forward(self) -> torch.Tensor:
        return _local(self.weight)
