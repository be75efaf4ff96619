"""Document masking: attention that stays inside each document of a packed window.

A packed training window holds the tail of one document, some whole ones and the head of another.
`documents` (batch, seq) gives each token's document id; a document's tokens are one contiguous
run of equal ids. Query i may see key j when j <= i and both lie in the same document: the
causal mask cut into blocks along the diagonal, one per document.

Kernels: on CUDA FlexAttention with a block mask (compiled; blocks of keys outside the query's
document are never computed); elsewhere the blockwise attention of models/attention/masked.py
(blocks outside the documents skipped, a block-sized mask where a document boundary crosses a
block, never a (seq, seq) tensor). `document_causal_mask` is the quadratic reference (tests).
"""

from __future__ import annotations

import functools

import torch

from fivefold.models.attention.masked import masked_attention


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document (0 at the document's first token in the window)."""
    index = torch.arange(documents.shape[-1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


def document_causal_mask(documents: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool, True where query i may see key j: j <= i, same document."""
    seq = documents.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    return ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]


def use_flex_attention(q: torch.Tensor) -> bool:
    # The compiled FlexAttention kernel is CUDA's (untested in CPU-only CI, see the README);
    # eager FlexAttention elsewhere would materialise the scores anyway.
    return q.device.type == "cuda"


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


# The block mask of the last `documents` tensor: every layer of a forward passes the same one.
# Holding the tensor keeps its identity unique while it is cached.
_last_block_mask: tuple = (None, None)


def _block_mask(documents: torch.Tensor, device):
    global _last_block_mask
    from torch.nn.attention.flex_attention import create_block_mask

    if _last_block_mask[0] is not documents:
        def same_document_causal(b, h, q_index, kv_index):
            return (q_index >= kv_index) & (documents[b, q_index] == documents[b, kv_index])

        batch, seq = documents.shape
        _last_block_mask = (documents, create_block_mask(same_document_causal, batch, None, seq, seq, device=device))
    return _last_block_mask[1]


def flex_document_attention(q, k, v, documents, compiled: bool = True) -> torch.Tensor:
    """Document-causal attention through FlexAttention's block mask (`compiled=False`: eager)."""
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = _block_mask(documents, q.device)
    kernel = _compiled_flex_attention() if compiled else flex_attention
    return kernel(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention over (batch, heads, seq, head_dim) that never crosses a document
    boundary; K/V may have fewer heads (GQA) and V another head dim (Multi-head Latent Attention)."""
    if use_flex_attention(q):
        return flex_document_attention(q, k, v, documents)
    return masked_attention(q, k, v, documents=documents)
