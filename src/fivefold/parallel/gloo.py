"""What gloo (the CPU backend) does worse than the textbook, for the callers that work around it."""

from __future__ import annotations

import torch.distributed as dist


def reduce_scatter_via_all_to_all(group) -> bool:
    """Whether to reduce-scatter over `group` as an all-to-all plus a local sum.

    gloo runs a reduce-scatter as an all-reduce of the whole input followed by a slice; an
    all-to-all of the same input moves the textbook (N-1)/N of it and, with the sum, takes 2-4x
    less time (benchmarks/gloo_collectives.py). NCCL's reduce-scatter is the real thing.
    """
    return dist.get_backend(group) == "gloo"
