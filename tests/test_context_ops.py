"""Context-parallel attention against full single-device causal SDPA: outputs and dq/dk/dv.

Each rank builds the same whole q/k/v/dout (seeded), keeps its load-balanced share, runs one
method over the cp group and compares its share of the output and gradients with the same share
of the single-device result. One spawn per world size runs every case.
"""

import datetime
import math

import pytest
import torch
import torch.nn.functional as F

from attention_inputs import attention_inputs
from ranks import run_on_ranks

from fivefold.parallel.context import blocks as attention_blocks
from fivefold.parallel.context.apply import SequenceSplit, local_positions

TOL = 1e-5  # fp32
METHODS = ("ring", "allgather", "ulysses")
# (batch, heads, kv_heads, seq, head_dim[, v_head_dim]): GQA, MQA and plain multi-head; odd head
# dims; batch > 1; V's head dim other than Q's and K's (Multi-head Latent Attention: 6 vs 4, and
# wider under GQA).
SHAPES = [(2, 4, 2, 16, 5), (1, 4, 1, 24, 7), (3, 4, 4, 8, 3), (2, 8, 2, 32, 9), (2, 4, 4, 16, 6, 4),
          (1, 4, 2, 16, 5, 8)]


def _reference(q, k, v, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _errors_on_rank(cases):
    """Max abs error of (out, dq, dk, dv) per (method, shape) case on this rank."""
    import torch.distributed as dist

    from fivefold.parallel.context.apply import ContextParallelAttention

    group = dist.group.WORLD
    rank, cp = dist.get_rank(), dist.get_world_size()
    errors = {}
    for method, shape in cases:
        q, k, v, dout = attention_inputs(shape, seed=sum(shape))
        want = _reference(q, k, v, dout)
        mine = local_positions(rank, cp, shape[3] // cp)
        local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
        out = ContextParallelAttention(group, method)(*local)
        out.backward(dout[:, :, mine])
        got = (out.detach(), local[0].grad, local[1].grad, local[2].grad)
        errors[(method, shape)] = [(g - w[:, :, mine]).abs().max().item() for g, w in zip(got, want)]
    return errors


def _cases(cp):
    return [(m, s) for m in METHODS for s in SHAPES if m != "ulysses" or s[1] % cp == 0]


@pytest.fixture(scope="module")
def cp2_errors():
    return run_on_ranks(2, _errors_on_rank, _cases(2))


@pytest.fixture(scope="module")
def cp4_errors():
    return run_on_ranks(4, _errors_on_rank, _cases(4))


@pytest.mark.parametrize("method", METHODS)
def test_matches_sdpa_cp2(cp2_errors, method):
    _assert_small(cp2_errors, method)


@pytest.mark.parametrize("method", METHODS)
def test_matches_sdpa_cp4(cp4_errors, method):
    _assert_small(cp4_errors, method)


def _assert_small(per_rank, method):
    checked = 0
    for rank, errors in enumerate(per_rank):
        for (case_method, shape), errs in errors.items():
            if case_method != method:
                continue
            checked += 1
            for name, err in zip(("out", "dq", "dk", "dv"), errs):
                assert err <= TOL, f"{method} {shape} rank {rank}: {name} off by {err}"
    assert checked


# ---- single process: the block math, the split, the fused kernel's call signatures ---------------

def _masked_reference(q, k, v, causal, dout):
    """Attention of one block by the book, with autograd (GQA by expanding kv)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ v.repeat_interleave(group, 1)
    out.backward(dout)
    return out.detach(), scores.logsumexp(-1).detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("kernel", ["plain", "cpu flash"])
@pytest.mark.parametrize("causal", [True, False])
def test_block_math_with_small_query_tiles(monkeypatch, causal, kernel):
    """Both CPU paths are attention by the book; tiling the plain path's query rows (3 or 4 at a
    time here) changes nothing."""
    monkeypatch.setattr(attention_blocks, "TILE_ELEMENTS", 250)  # batch 2 x 4 heads x 7-10 keys per row
    if kernel == "plain":  # the path for devices without a fused kernel
        monkeypatch.setattr(attention_blocks, "use_cpu_flash_kernel", lambda q, v: False)
    g = torch.Generator().manual_seed(0)
    q, dout = torch.randn(2, 4, 10, 6, generator=g), torch.randn(2, 4, 10, 6, generator=g)
    lk = 10 if causal else 7
    k, v = torch.randn(2, 2, lk, 6, generator=g), torch.randn(2, 2, lk, 6, generator=g)
    out_ref, lse_ref, *grads_ref = _masked_reference(q, k, v, causal, dout)
    out, lse = attention_blocks.block_forward(q, k, v, causal, 6 ** -0.5)
    assert torch.allclose(out, out_ref, atol=TOL) and torch.allclose(lse, lse_ref, atol=TOL)
    grads = attention_blocks.block_backward(dout, q, k, v, out, lse, causal, 6 ** -0.5)
    for name, got, want in zip("qkv", grads, grads_ref):
        assert torch.allclose(got, want, atol=TOL), f"d{name}"


def test_merge_of_two_key_halves_is_exact():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 4, 3, generator=g) for _ in range(3))
    whole, whole_lse = attention_blocks.block_forward(q, k, v, False, 0.5)
    out, lse = attention_blocks.block_forward(q, k[:, :, :2], v[:, :, :2], False, 0.5)
    part, part_lse = attention_blocks.block_forward(q, k[:, :, 2:], v[:, :, 2:], False, 0.5)
    attention_blocks.merge_rows(out, lse, slice(None), part, part_lse)
    assert torch.allclose(out, whole, atol=1e-6) and torch.allclose(lse, whole_lse, atol=1e-6)


def test_sequence_split_is_balanced_and_complete():
    windows = torch.arange(17).repeat(2, 1)  # seq_len 16 (+1 for labels)
    cp = 4
    parts = [SequenceSplit(rank, cp)(windows) for rank in range(cp)]
    positions = torch.cat([p[2].flatten() for p in parts])
    assert sorted(positions.tolist()) == list(range(16))
    assert parts[0][2].tolist() == [[0, 1, 14, 15]]  # chunks 0 and 7 of 8
    for inputs, labels, pos in parts:
        assert inputs.shape == (2, 4)
        assert torch.equal(inputs[0], pos[0]) and torch.equal(labels[0], pos[0] + 1)
        # Causal work: keys at or before each query, summed over the rank's queries: equal for all.
        assert int((pos + 1).sum()) == int((parts[0][2] + 1).sum())
    inputs, labels, pos = SequenceSplit()(windows)
    assert pos is None and inputs.shape == (2, 16)


@pytest.mark.parametrize("causal", [True, False])
def test_fused_kernel_call_signatures_on_meta(monkeypatch, causal):
    """The CUDA path cannot run here; meta tensors at least check its calls' arguments and shapes."""
    monkeypatch.setattr(attention_blocks, "use_fused_kernel", lambda q: True)
    q, dout = torch.empty(2, 4, 40, 8, device="meta"), torch.empty(2, 4, 40, 8, device="meta")
    k = v = torch.empty(2, 2, 40 if causal else 20, 8, device="meta")
    out, lse = attention_blocks.block_forward(q, k, v, causal, 0.3)
    assert out.shape == q.shape and lse.shape == (2, 4, 40) and out.dtype == lse.dtype == torch.float32
    dq, dk, dv = attention_blocks.block_backward(dout, q, k, v, out, lse, causal, 0.3)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def _stalled_peer(_):
    """Rank 1 never joins the ring: rank 0 must get an error at the group's timeout, not hang."""
    import time

    import torch.distributed as dist

    from fivefold.parallel.context.ring import ring_attention

    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    if dist.get_rank() == 1:
        time.sleep(6)
        return "idle"
    q = torch.randn(1, 2, 4, 3)
    start = time.monotonic()
    try:
        ring_attention(q, q, q, group)
    except Exception as error:  # noqa: BLE001 - any timeout error will do
        return f"raised after {time.monotonic() - start:.1f}s: {type(error).__name__}"
    return "completed"


def test_ring_times_out_instead_of_hanging():
    result = run_on_ranks(2, _stalled_peer, None, timeout_s=60)[0]
    assert result.startswith("raised"), result
