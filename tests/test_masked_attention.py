"""Single-device attention with windows, sinks and documents (models/attention/masked.py) runs
blockwise: equal to the quadratic implementation it replaced (SDPA with a (seq, seq) boolean mask
without sinks, fp32 (heads, seq, seq) scores with them) in outputs and in the gradients of q, k, v
and the sinks — fp32 within 1e-5, bf16 within bf16 rounding — and builds no (seq, seq) tensor in
forward or backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fivefold.models.attention.documents import document_attention
from fivefold.models.attention.masked import allowed_keys, attention_parts, masked_attention, sink_attention


def quadratic_attention(q, k, v, window=0, documents=None, sinks=None):
    """The implementation before blockwise attention (fivefold 7c23664), kept as the reference."""
    mask = allowed_keys(q.shape[2], q.device, window, documents)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return sink_attention(q, k, v, mask, sinks)


def _documents(batch, seq, cuts):
    ids = torch.zeros(batch, seq, dtype=torch.int64)
    for row, bounds in enumerate(cuts):
        for start in bounds:
            ids[row, start:] += 1
    return ids


# (batch, heads, kv_heads, seq, head_dim, v_dim), window, sinks, document starts per row, chunk
CASES = [
    ((2, 4, 2, 37, 8, 8), 5, False, None, 16),        # GQA; odd seq; window < chunk
    ((1, 4, 2, 37, 8, 8), 16, True, None, 16),        # window = chunk: causal + mirrored tiles
    ((1, 4, 1, 100, 8, 8), 40, True, None, 32),       # window > chunk, not a multiple; seq % chunk != 0
    ((2, 4, 4, 70, 8, 8), 0, True, None, 16),         # sinks alone: one causal block
    ((2, 4, 2, 70, 8, 8), 0, False, [[9, 40], [33]], 16),  # documents alone
    ((2, 4, 2, 70, 8, 8), 0, True, [[9, 40], []], 32),     # documents and sinks
    ((1, 6, 2, 131, 16, 16), 24, True, [[3, 60, 61, 100]], 32),  # windows + sinks + documents
    ((1, 4, 2, 64, 8, 6), 12, True, [[20]], 16),      # V's head dim other than Q's (plain path)
    ((1, 4, 2, 50, 8, 8), 64, True, None, 16),        # window longer than the sequence
    ((1, 4, 2, 300, 8, 8), 128, True, None, 128),     # gpt-oss's window, the default chunk
]


def _inputs(shape, with_sinks, cuts, dtype, seed):
    batch, heads, kv_heads, seq, head_dim, v_dim = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, seq, v_dim, generator=gen)
    sinks = torch.randn(heads, generator=gen) * 2 if with_sinks else None
    dout = torch.randn(batch, heads, seq, v_dim, generator=gen)
    documents = None if cuts is None else _documents(batch, seq, cuts)
    cast = [t.to(dtype) for t in (q, k, v)]
    return cast, sinks, documents, dout.to(dtype)


def _run(fn, qkv, sinks, window, documents, dout, **kw):
    leaves = [t.clone().requires_grad_() for t in qkv]
    sink = None if sinks is None else sinks.clone().requires_grad_()
    out = fn(*leaves, window, documents, sink, **kw)
    out.backward(dout)
    return [out.detach(), *(t.grad for t in leaves)] + ([] if sink is None else [sink.grad])


@pytest.mark.parametrize("index", range(len(CASES)))
def test_blockwise_equals_the_quadratic_attention_fp32(index):
    shape, window, with_sinks, cuts, chunk = CASES[index]
    qkv, sinks, documents, dout = _inputs(shape, with_sinks, cuts, torch.float32, index)
    got = _run(masked_attention, qkv, sinks, window, documents, dout, chunk=chunk)
    want = _run(quadratic_attention, qkv, sinks, window, documents, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        assert (a - b).abs().max().item() <= 1e-5, f"{name} off by {(a - b).abs().max().item()}"


@pytest.mark.parametrize("index", [0, 2, 4, 6])
def test_blockwise_bf16_is_within_bf16_rounding(index):
    """bf16 inputs: the blockwise result is within bf16 rounding of the fp32 result of the same
    inputs (two bf16 steps of the largest value: out and its gradients are rounded to bf16, and
    backward reads the bf16 output, as flash attention does), as the quadratic one is."""
    shape, window, with_sinks, cuts, chunk = CASES[index]
    qkv, sinks, documents, dout = _inputs(shape, with_sinks, cuts, torch.bfloat16, index)
    exact = _run(quadratic_attention, [t.float() for t in qkv], sinks, window, documents, dout.float())
    got = _run(masked_attention, qkv, sinks, window, documents, dout, chunk=chunk)
    old = _run(quadratic_attention, qkv, sinks, window, documents, dout)
    for name, g, o, e in zip(("out", "dq", "dk", "dv", "dsinks"), got, old, exact):
        assert g.dtype == o.dtype
        bound = 2 ** -7 * e.abs().max().item()  # two steps of bf16's 8 significant bits
        assert (g.float() - e).abs().max().item() <= bound, f"{name}: beyond bf16 rounding"
        assert (o.float() - e).abs().max().item() <= bound, f"{name}: the reference itself"


def test_document_attention_is_blockwise_and_equal():
    shape, _, _, cuts, _ = CASES[4]
    qkv, _, documents, dout = _inputs(shape, False, cuts, torch.float32, 4)
    got = _run(lambda q, k, v, window, docs, sinks: document_attention(q, k, v, docs), qkv, None, 0, documents, dout)
    want = _run(quadratic_attention, qkv, None, 0, documents, dout)
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() <= 1e-5


class LargestTensor(TorchDispatchMode):
    """The largest product of the last two dims over every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                self.largest = max(self.largest, t.shape[-1] * t.shape[-2])
        return out


@pytest.mark.parametrize("window, with_sinks, cuts", [(24, True, None), (0, True, [[100, 101, 300]]),
                                                      (40, False, [[250]]), (0, False, [[100]])])
def test_no_tensor_is_quadratic_in_the_sequence(window, with_sinks, cuts):
    seq, chunk = 512, 64
    qkv, sinks, documents, dout = _inputs((1, 4, 2, seq, 16, 16), with_sinks, cuts, torch.float32, 0)
    leaves = [t.requires_grad_() for t in qkv] + ([] if sinks is None else [sinks.requires_grad_()])
    with LargestTensor() as probe:
        out = masked_attention(*qkv, window, documents, sinks, chunk=chunk)
        torch.autograd.grad(out, leaves, dout)
    # The largest: (seq, head_dim) rows of q, k, v, out themselves, or one block's scores or mask.
    assert probe.largest <= max(seq * 16, chunk * (chunk + window)) < seq * seq // 16, probe.largest
    with LargestTensor() as probe:  # the probe sees what the quadratic implementation builds
        quadratic_attention(*qkv, window, documents, sinks)
    assert probe.largest >= seq * seq


def test_blocks_outside_the_window_and_the_documents_are_not_visited():
    seq, chunk = 1024, 128
    windowed = attention_parts(seq, 128, None, "cpu", chunk)
    assert sum(b.rows.stop - b.rows.start for b, _ in windowed if b.causal) == seq  # the diagonal once
    assert all(mask is None for _, mask in windowed)  # window = chunk: all kernel tiles, no mask
    # Each query chunk: its own block causally, the previous one's mirrored tile; nothing else.
    assert len(windowed) == 2 * (seq // chunk) - 1
    documents = _documents(1, seq, [[500]])
    parts = attention_parts(seq, 0, documents, "cpu", chunk)
    # Query chunks after the boundary never visit key chunks before it.
    assert all(b.cols.start >= 384 for b, _ in parts if b.rows.start >= 512)
    assert [b for b, _ in attention_parts(seq, 0, None, "cpu")] == [attention_parts(seq, 2000, None, "cpu")[0][0]]
