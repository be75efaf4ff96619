"""Seeded attention inputs for the attention tests (test_context_ops, test_document_mask): every
process that builds them from the same shape and seed holds the same whole tensors, so a cp rank
can keep its share and compare it with a single-process reference."""

import torch


def attention_inputs(shape, seed):
    """(q, k, v, dout) for shape (batch, heads, kv_heads, seq, head_dim[, v_head_dim]); V's head
    dim is head_dim unless given (Multi-head Latent Attention's differs)."""
    batch, heads, kv_heads, seq, head_dim = shape[:5]
    v_dim = shape[5] if len(shape) > 5 else head_dim
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, head_dim, generator=g)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=g)
    v = torch.randn(batch, kv_heads, seq, v_dim, generator=g)
    dout = torch.randn(batch, heads, seq, v_dim, generator=g)
    return q, k, v, dout
