"""Tensor parallelism (+ sequence parallelism): weights as DTensors, layers computing locally.

Megatron's layout: q/k/v and the MLP's w1/w3 split by output columns (heads / hidden units), wo
and w2 by input rows, so each block needs one all-reduce in forward and one in backward. With
sequence parallelism the all-reduce becomes a reduce-scatter (after wo/w2) plus an all-gather
(before q/k/v and w1/w3), and norms and residuals run on a 1/tp slice of the sequence. The layers
(parallel/tp_layers.py) compute on their local shards between those explicit collectives.

The embedding is split by vocabulary rows and the output layer by vocabulary columns: logits stay
sharded over tp (a DTensor) and the loss is computed by PyTorch's `loss_parallel` without ever
gathering them. Heads split evenly, so validate() requires tp to divide n_heads and n_kv_heads
(no kv replication), and the vocabulary splits evenly too.
"""

from __future__ import annotations

from torch import nn

from fivefold.models.llama import FeedForward
from fivefold.parallel.tp_layers import (ColumnParallelLinear, RowParallelLinear, SequenceShardedRMSNorm,
                                         TensorParallelGroup, VocabParallelEmbedding, VocabParallelOutput)


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    group = TensorParallelGroup(tp_mesh, sequence_parallel)
    # A pipeline stage has only some of these modules.
    tied = (model.output is not None and model.tok_embeddings is not None
            and model.output.weight is model.tok_embeddings.weight)
    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, group, group.scatter_sequence)
    if model.norm is not None and sequence_parallel:
        model.norm = SequenceShardedRMSNorm(model.norm, group)
    if model.output is not None:
        model.output = VocabParallelOutput(model.output, group)
    if tied:
        # Both layers split the same (vocab, dim) matrix by vocabulary rows: keep one parameter.
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        parallelize_block(block, group)


def parallelize_block(block: nn.Module, group: TensorParallelGroup) -> None:
    """Swap a block's layers for tp ones that compute on local shards (parallel/tp_layers.py).

    Attention gathers the whole sequence in order (positions matter); the dense MLP is per token, so
    it gathers every token of the tp group in whatever order the collective delivers them. MoE
    layers are laid out by parallel/expert.py."""
    attention = block.attention
    for name in ("wq", "wk", "wv"):
        setattr(attention, name, ColumnParallelLinear(getattr(attention, name), group))
    attention.wo = RowParallelLinear(attention.wo, group, group.scatter_sequence)
    attention.register_forward_pre_hook(_gather_first_input(group.gather_sequence))
    if isinstance(block.feed_forward, FeedForward):
        mlp = block.feed_forward
        mlp.w1, mlp.w3 = ColumnParallelLinear(mlp.w1, group), ColumnParallelLinear(mlp.w3, group)
        mlp.w2 = RowParallelLinear(mlp.w2, group, group.scatter_tokens)
        mlp.register_forward_pre_hook(_gather_first_input(group.gather_tokens))
    if group.sequence_parallel:
        block.attention_norm = SequenceShardedRMSNorm(block.attention_norm, group)
        block.ffn_norm = SequenceShardedRMSNorm(block.ffn_norm, group)


def _gather_first_input(gather):
    def hook(module, args):
        return (gather(args[0]), *args[1:])
    return hook
