"""Attention over one block of queries and keys, returning the log-sum-exp, and its backward
(implemented in models/attention_blocks.py, parallelism-free; re-exported here).

Context parallelism computes attention a block at a time (a query chunk against a key/value chunk)
and merges the blocks exactly with the online-softmax rule. That needs, per block, the output and
the log-sum-exp (LSE) of each query row; the backward of a block needs the *final* (merged) output
and LSE, which turn the block's scores into the true global probabilities.

Shapes: q (batch, heads, Lq, head_dim); k, v (batch, kv_heads, Lk, head_dim) with kv_heads dividing
heads (grouped-query attention). `causal` blocks are square (Lq == Lk, the same token positions):
query i sees keys 0..i. Other blocks are fully visible. Outputs and LSE are fp32 (accumulators).

Document masking (`data.document_mask`) adds a `mask` (batch, Lq, Lk), True where a query may see a
key: `document_block` derives it from the document ids of the block's rows and columns, says when
no pair is visible (the caller skips the block) and drops the mask when it hides nothing the block
does not hide already (the fast kernels then run). A row that sees no key of a block gets LSE −inf
and output 0, which the merge folds in as nothing.

Three implementations: PyTorch's fused kernels, which return the LSE themselves and take the
global output/LSE in their backward — memory-efficient attention on CUDA, flash attention on CPU
(computed in fp32 there, like the plain path) — and plain PyTorch for any other device (matmul +
logsumexp, tiled over query rows so the score matrix stays small).
"""

# The block math is parallelism-free and lives with the model's attention; context parallelism
# uses it from there. Re-exported here for the cp methods and their tests.
from fivefold.models.attention_blocks import (TILE_ELEMENTS, block_backward, block_forward,  # noqa: F401
                                              document_block, merge_rows, use_cpu_flash_kernel,
                                              use_fused_kernel)
