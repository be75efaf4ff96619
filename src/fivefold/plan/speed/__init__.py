"""How long the pieces of a step take on a GPU: matmuls by shape (gemm.py), the attention core by
kernel (attention.py), the busiest expert-parallel rank (expert_load.py) and accumulating weight
gradients (grad_accum.py)."""
