"""The memory traffic of accumulating each micro-batch's weight gradients, per trained weight.

Gradient accumulation over micro-batches is an elementwise pass over every weight a rank trains,
once per micro-batch, bound by memory bandwidth, on the compute stream (nothing overlaps it):
  - fivefold's bf16 recipe (parallel/data/zero.py main_grads) and nanotron's fp32 accumulator: a
    hook reads the bf16 gradient autograd wrote (2) and reads and writes the fp32 buffer (4 + 4);
  - fp32 weights: autograd stores the first micro-batch's gradient and adds the later ones in place
    (read 4 + 4, write 4);
  - DeepSpeed's pipeline engine: autograd adds each 16-bit gradient into .grad in place (2 + 2 + 2)
    after the first;
  - Megatron's gradient-accumulation fusion: the weight-gradient GEMM accumulates into the fp32
    buffer in its epilogue, no pass of its own;
  - FSDP2 (zero 3) reduce-scatters every micro-batch's gradient and adds it into the rank's fp32
    shard (parallel/data/fsdp.py): the same in-place add, over 1/shard of the weights. Under a
    pipeline PyTorch's stage reduce-scatters once, after the last backward: FSDP2 upcasts the first
    micro-batch's whole bf16 gradient to fp32 (2 + 4) and adds the later ones into it (2 + 4 + 4).
"""

from __future__ import annotations


def accumulation_bytes_per_weight(precision, layout, runtime, micro_batches: int) -> float:
    """Bytes moved per trained weight of a rank per micro-batch, averaged over the step's micro-batches."""
    later = (micro_batches - 1) / micro_batches  # the first micro-batch's gradient is stored, not added
    if runtime.grad_accum == "fused":
        return 0.0
    if layout.zero >= 3 and layout.pp > 1:
        if precision.param_bytes < 4:
            return (6.0 + 10.0 * (micro_batches - 1)) / micro_batches
        return 12.0 * later
    if layout.zero >= 3:
        return 12.0 * later / layout.shard_degree
    if runtime.grad_accum == "autograd":
        return 3.0 * precision.param_bytes * later
    if precision.param_bytes < 4:  # a 16-bit gradient added into an fp32 buffer by a hook
        return precision.param_bytes + 8.0
    return 12.0 * later
