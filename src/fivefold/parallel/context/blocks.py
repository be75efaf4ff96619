"""Attention over one block of queries and keys, returning the log-sum-exp, and its backward
(implemented in models/attention_blocks.py, parallelism-free; re-exported here).

Context parallelism computes attention a block at a time (a query chunk against a key/value chunk)
and merges the blocks exactly with the online-softmax rule; the shapes, document masks, merge rule
and the three kernel paths are described in models/attention_blocks.py.
"""

# The block math is parallelism-free and lives with the model's attention; context parallelism
# uses it from there. Re-exported here for the cp methods and their tests.
from fivefold.models.attention_blocks import (TILE_ELEMENTS, block_backward, block_forward,  # noqa: F401
                                              document_block, merge_rows, use_cpu_flash_kernel,
                                              use_fused_kernel)
