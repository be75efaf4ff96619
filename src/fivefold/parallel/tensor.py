"""Tensor parallelism (+ sequence parallelism) with PyTorch's DTensor `parallelize_module`.

Megatron's layout: q/k/v and the MLP's w1/w3 split by output columns (heads / hidden units), wo
and w2 by input rows, so each block needs one all-reduce in forward and one in backward. With
sequence parallelism the all-reduce becomes a reduce-scatter (after wo/w2) plus an all-gather
(before q/k/v and w1/w3), and norms and residuals run on a 1/tp slice of the sequence.

The embedding is split by vocabulary rows and the output layer by vocabulary columns: logits stay
sharded over tp and the loss is computed by `loss_parallel` without ever gathering them. Heads
split evenly, so validate() requires tp to divide n_heads and n_kv_heads (no kv replication).
"""

from __future__ import annotations

from torch import nn

from fivefold.models.llama import FeedForward
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    # Layout of the residual stream between blocks: split along the sequence, or whole.
    stream = Shard(1) if sequence_parallel else Replicate()

    top_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "output": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        top_plan["norm"] = SequenceParallel()
    # A pipeline stage has only some of these modules.
    top_plan = {name: style for name, style in top_plan.items() if getattr(model, name) is not None}
    tied = (model.output is not None and model.tok_embeddings is not None
            and model.output.weight is model.tok_embeddings.weight)
    parallelize_module(model, tp_mesh, top_plan)
    if tied:
        # Both layers shard the same (vocab, dim) matrix by vocabulary rows: keep one parameter.
        model.output.weight = model.tok_embeddings.weight

    for block in model.layers.values():
        block_plan = {
            # cos/sin (the 2nd and 3rd inputs) are the same on every tp rank: leave them alone.
            "attention": PrepareModuleInput(input_layouts=(stream, None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=stream),
            "feed_forward": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=stream),
        }
        if sequence_parallel:
            block_plan["attention_norm"] = SequenceParallel()
            block_plan["ffn_norm"] = SequenceParallel()
        if not isinstance(block.feed_forward, FeedForward):  # MoE: parallel/expert.py lays it out
            block_plan = {k: v for k, v in block_plan.items() if not k.startswith("feed_forward")}
        parallelize_module(block, tp_mesh, block_plan)
