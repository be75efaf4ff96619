"""Document masking (`data.document_mask`): attention never crosses a document boundary.

Here, in one process: the model's attention core, FlexAttention's mask (eager), the masked block
math of context parallelism and the data side (document ids beside the tokens, bad input). The
context-parallel methods run `document_op_errors` inside the cp spawns of
tests/test_context_parallel.py, and training with document masking is checked against the single
process there (cp2 ring / allgather / ulysses, tp2, pp2, bf16) and in tests/test_composition.py
(one 16-rank 5D layout). Every reference runs each document on its own.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from attention_inputs import attention_inputs

from fivefold.config import ConfigError, DataConfig
from fivefold.models.decoder import CausalAttention
from fivefold.models.attention.documents import document_positions, flex_document_attention
from fivefold.models.attention import blocks as attention_blocks

TOL = 1e-5  # fp32
METHODS = ("ring", "allgather", "ulysses")


def _ids(batch_bounds, seq):
    """(batch, seq) document ids from each row's list of document starts (besides 0)."""
    rows = []
    for bounds in batch_bounds:
        row = torch.zeros(seq, dtype=torch.int64)
        for start in bounds:
            row[start:] += 1
        rows.append(row)
    return torch.stack(rows)


# (batch, heads, kv_heads, seq, head_dim, v_head_dim), document starts per row. At cp2 the chunks
# are 4 tokens (seq 16) or 6 (seq 24): boundaries on and off chunk edges, documents shorter than a
# chunk, a row that is one document (nothing masked), a row of one-token documents; a start at 12
# of 16 leaves rank 0's late chunk (12..15) no key of the other rank: a block skipped.
CASES = [
    ((2, 4, 2, 16, 5, 5), [[3, 9, 10], [8]]),
    ((1, 4, 1, 24, 7, 7), [[1, 2, 3, 12, 13, 23]]),
    ((1, 4, 4, 16, 6, 4), [[12]]),  # V's head dim other than Q's (Multi-head Latent Attention)
    ((2, 4, 2, 16, 5, 8), [[], list(range(1, 16))]),
    ((1, 8, 2, 32, 9, 9), [[5, 16, 17, 30]]),
]


def each_document_alone(q, k, v, dout, documents):
    """(out, dq, dk, dv) with every document of every row run through causal attention alone."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],))
    for b in range(q.shape[0]):
        for doc in documents[b].unique():
            at = (documents[b] == doc).nonzero().flatten()
            out[b, :, at] = F.scaled_dot_product_attention(
                q[b:b + 1, :, at], k[b:b + 1, :, at], v[b:b + 1, :, at], is_causal=True,
                enable_gqa=q.shape[1] != k.shape[1])[0]
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _run(attend, q, k, v, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _assert_close(got, want, label):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        err = (g - w).abs().max().item()
        assert err <= TOL, f"{label}: {name} off by {err}"


# ---- the model's attention core ---------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("index", range(len(CASES)))
def test_core_equals_each_document_alone(index):
    shape, bounds = CASES[index]
    q, k, v, dout = attention_inputs(shape, seed=index)
    documents = _ids(bounds, shape[3])
    want = each_document_alone(q, k, v, dout, documents)
    _assert_close(_run(lambda *t: CausalAttention()(*t, documents), q, k, v, dout), want, "sdpa mask")
    # The CUDA kernel's mask function, run eagerly (FlexAttention has no CPU backward: outputs only).
    flex = flex_document_attention(q, k, v, documents, compiled=False)
    assert (flex - want[0]).abs().max().item() <= TOL, "flex attention"


def test_core_without_documents_is_plain_causal():
    q, k, v, dout = attention_inputs((1, 4, 2, 12, 5, 5), seed=9)
    one = torch.zeros(1, 12, dtype=torch.int64)
    _assert_close(_run(lambda *t: CausalAttention()(*t, one), q, k, v, dout),
                  _run(CausalAttention(), q, k, v, dout), "one document")


def test_document_positions_restart_at_each_document():
    ids = _ids([[3, 4], []], 6)
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]]


# ---- the block math of context parallelism ---------------------------------------------------

def _masked_by_the_book(q, k, v, allowed, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    lse = scores.logsumexp(-1)
    probs = (scores - lse.nan_to_num(neginf=0.0)[..., None]).exp()  # a row that sees nothing: 0
    out = probs @ v.repeat_interleave(group, 1)
    out.backward(dout)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("causal", [True, False])
def test_masked_block_math_with_small_query_tiles(monkeypatch, causal):
    """Masked blocks (plain path, 3-4 query rows per tile) are attention by the book, rows that see
    no key of the block included (LSE −inf, output 0), and merge as contributing nothing."""
    monkeypatch.setattr(attention_blocks, "TILE_ELEMENTS", 250)
    g = torch.Generator().manual_seed(0)
    q, dout = torch.randn(2, 4, 10, 6, generator=g), torch.randn(2, 4, 10, 6, generator=g)
    lk = 10 if causal else 7
    k, v = torch.randn(2, 2, lk, 6, generator=g), torch.randn(2, 2, lk, 6, generator=g)
    q_docs = _ids([[4, 8], [2]], 10)
    k_docs = q_docs if causal else _ids([[1, 3], [7]], lk) + torch.tensor([[1], [0]])
    visible, mask = attention_blocks.document_block(q_docs, k_docs, causal)
    assert visible and mask is not None
    if not causal:
        assert not mask[0, :4].any()  # rows of document 0 see no key of this block
    out_ref, lse_ref, *grads_ref = _masked_by_the_book(q, k, v, mask, dout)
    out, lse = attention_blocks.block_forward(q, k, v, causal, 6 ** -0.5, mask)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    assert torch.allclose(out, out_ref, atol=TOL) and torch.allclose(lse, lse_ref, atol=TOL)
    whole_lse = torch.logaddexp(lse, torch.zeros_like(lse))  # as if another block gave every row mass
    grads = attention_blocks.block_backward(dout, q, k, v, out, whole_lse, causal, 6 ** -0.5, mask)
    assert all(torch.isfinite(t).all() for t in grads)
    # Merging a block whose rows see nothing leaves the running result as it was.
    running, running_lse = torch.ones_like(out), torch.zeros_like(lse)
    nothing = torch.full_like(lse, float("-inf"))
    attention_blocks.merge_rows(running, running_lse, slice(None), torch.zeros_like(out), nothing)
    assert torch.equal(running, torch.ones_like(out)) and torch.equal(running_lse, torch.zeros_like(lse))
    if causal:  # the final LSE is this block's: the gradients are the book's
        grads = attention_blocks.block_backward(dout, q, k, v, out, lse, causal, 6 ** -0.5, mask)
        for name, got, want in zip("qkv", grads, grads_ref):
            assert torch.allclose(got, want, atol=TOL), f"d{name}"


def test_document_block_skips_and_unmasks():
    one, other = torch.zeros(1, 4, dtype=torch.int64), torch.ones(1, 4, dtype=torch.int64)
    assert attention_blocks.document_block(one, other, causal=False)[0] is False  # skipped
    assert attention_blocks.document_block(one, one, causal=False) == (True, None)  # fast kernel
    assert attention_blocks.document_block(one, one, causal=True) == (True, None)
    split = torch.tensor([[0, 0, 1, 1]])
    visible, mask = attention_blocks.document_block(split, split, causal=True)
    assert visible and mask[0].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


# ---- the context-parallel methods, run inside the cp spawns of test_context_parallel.py --------

def document_op_errors():
    """Max abs error of (out, dq, dk, dv) per (method, case) on this rank, against every document
    run alone; a case the layout cannot split (ulysses heads, seq) is left out."""
    import torch.distributed as dist

    from fivefold.parallel.context.apply import ContextParallelAttention, local_positions

    group = dist.group.WORLD
    rank, cp = dist.get_rank(), dist.get_world_size()
    errors = {}
    for method in METHODS:
        for index, (shape, bounds) in enumerate(CASES):
            if shape[3] % (2 * cp) or (method == "ulysses" and shape[1] % cp):
                continue
            q, k, v, dout = attention_inputs(shape, seed=index)
            documents = _ids(bounds, shape[3])
            want = each_document_alone(q, k, v, dout, documents)
            mine = local_positions(rank, cp, shape[3] // cp)
            local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
            out = ContextParallelAttention(group, method)(*local, documents[:, mine])
            out.backward(dout[:, :, mine])
            got = (out.detach(), local[0].grad, local[1].grad, local[2].grad)
            errors[(method, index)] = [(g - w[:, :, mine]).abs().max().item() for g, w in zip(got, want)]
    return errors


def assert_document_ops_exact(per_rank, method):
    checked = 0
    for rank, errors in enumerate(per_rank):
        for (case_method, index), errs in errors.items():
            if case_method == method:
                checked += 1
                for name, err in zip(("out", "dq", "dk", "dv"), errs):
                    assert err <= TOL, f"{method} case {index} rank {rank}: {name} off by {err}"
    assert checked


# ---- data: document ids beside the tokens ------------------------------------------------------

def _jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def _check_ids_follow_the_text(batches, steps=3):
    """Every document ends with the newline tokenizing appends (none inside): a token starts a new
    document exactly when the previous one is a newline; positions restart there."""
    for step in range(steps):
        windows = batches.rank_batch(step)
        tokens, ids = windows.tokens, windows.documents
        assert torch.equal(ids[:, 1:] != ids[:, :-1], tokens[:, :-1] == ord("\n"))
        assert int(ids[:, 0].abs().sum()) == 0
        assert torch.equal(windows.positions, document_positions(ids))


def test_windows_carry_document_ids(tmp_path):
    from fivefold.data.batches import load_training_data
    from fivefold.data.prepare import prepare

    docs_a = [f"{'a' * (1 + i % 7)} " * (1 + i % 5) for i in range(300)]
    docs_b = [f"{'b' * (1 + i % 3)} " * (1 + i % 4) for i in range(200)]
    raw = _jsonl(tmp_path / "a.jsonl", docs_a)
    for name in ("A", "B"):
        source = _jsonl(tmp_path / f"{name}.jsonl", docs_a if name == "A" else docs_b)
        prepare([source], "byte", str(tmp_path / name), workers=1, unit_bytes=2000, progress=False)
    for cfg in (DataConfig(source=raw, document_mask=True),
                DataConfig(source=str(tmp_path / "A"), document_mask=True),
                DataConfig(mix=f"{tmp_path / 'A'}:0.6,{tmp_path / 'B'}:0.4", document_mask=True)):
        train, held_out = load_training_data(cfg, 16, 256, 8, seed=4)
        _check_ids_follow_the_text(train)
        _check_ids_follow_the_text(held_out, steps=1)
        plain = load_training_data(DataConfig(**{**cfg.__dict__, "document_mask": False}), 16, 256, 8, seed=4)[0]
        assert torch.equal(train.rank_batch(2, 1, 2).tokens, plain.rank_batch(2, 1, 2))  # the same windows
    same_start = load_training_data(DataConfig(source=raw, document_mask=True, document_positions=False),
                                    16, 256, 8, seed=4)[0]
    assert same_start.rank_batch(0).positions is None  # 0, 1, 2... in every window


def test_document_mask_without_documents_gets_one_sentence(tmp_path):
    from fivefold.data.batches import load_training_data

    text = tmp_path / "book.txt"
    text.write_text("one long document\n" * 200)
    with pytest.raises(ConfigError) as error:
        load_training_data(DataConfig(source=str(text), document_mask=True), 16, 256, 8, seed=1)
    message = str(error.value)
    assert message.startswith(f"data.document_mask = true needs documents to keep attention inside, but "
                              f"data.source '{text}' holds 1 document"), message
    assert "\n" not in message
    load_training_data(DataConfig(source=str(text)), 16, 256, 8, seed=1)  # fine without the mask
