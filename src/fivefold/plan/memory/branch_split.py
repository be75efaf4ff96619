"""When selective recomputation checkpoints a block's residual branches apart (pure arithmetic:
parallel/recompute.py applies it, plan/memory/activations.py predicts with it; no torch here).

One checkpoint per block keeps each output projection's output: under tensor parallelism whole-
sequence partial sums, as wide as the stream and not split by tp. One per branch keeps instead the
stream between the branches and each projection's input, both split by tp. The second is smaller
for tensor-parallel degrees of about 4 and more (Llama shapes, bf16: 2.6 against 4 bytes per
token and unit of dim at tp4), the first below; each block takes the smaller. Per token of the
sequence, in bytes.
"""

from __future__ import annotations


def split_branches(stream_width: int, stream_split: int, stream_bytes: int, compute_bytes: int,
                   projection_inputs: list[int]) -> bool:
    """stream_width: the residual stream's width (dim); stream_split: how many ranks share its
    tokens (tp under sequence parallelism, else 1); projection_inputs: each output projection's
    input width on this rank."""
    if not projection_inputs:
        return False
    outputs = len(projection_inputs) * stream_width * compute_bytes
    apart = stream_width / stream_split * stream_bytes + sum(projection_inputs) * compute_bytes
    return apart < outputs
