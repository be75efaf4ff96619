"""Context-parallel attention against full single-device causal SDPA: outputs and dq/dk/dv; with
sliding windows, attention sinks and documents against the model's masked attention
(tests/window_ops.py), the blocks outside the window skipped.

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
from window_ops import CASES as WINDOW_CASES, assert_window_ops_exact, window_op_errors

from fivefold.models.attention import blocks as attention_blocks
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


def _rank_errors(cases):
    """Full causal attention's errors, then sliding windows' and sinks' (tests/window_ops.py)."""
    return _errors_on_rank(cases), window_op_errors()


@pytest.fixture(scope="module")
def cp2_spawn():
    return run_on_ranks(2, _rank_errors, _cases(2))


@pytest.fixture(scope="module")
def cp4_spawn():
    return run_on_ranks(4, _rank_errors, _cases(4))


@pytest.fixture(scope="module")
def cp2_errors(cp2_spawn):
    return [errors for errors, _ in cp2_spawn]


@pytest.fixture(scope="module")
def cp4_errors(cp4_spawn):
    return [errors for errors, _ in cp4_spawn]


@pytest.mark.parametrize("method", METHODS)
def test_matches_sdpa_cp2(cp2_errors, method):
    _assert_small(cp2_errors, method)


@pytest.mark.parametrize("method", METHODS)
def test_matches_sdpa_cp4(cp4_errors, method):
    _assert_small(cp4_errors, method)


@pytest.mark.parametrize("method", METHODS)
def test_windows_and_sinks_cp2(cp2_spawn, method):
    assert_window_ops_exact([windows for _, windows in cp2_spawn], method)


@pytest.mark.parametrize("method", METHODS)
def test_windows_and_sinks_cp4(cp4_spawn, method):
    assert_window_ops_exact([windows for _, windows in cp4_spawn], method)


def _chunk_pairs_outside(window: int, chunk: int, query_chunks, key_chunks) -> int:
    """Pairs of a query chunk and an earlier (or the same) key chunk no query of which sees a key
    of, counted position by position."""
    outside = 0
    for qc in query_chunks:
        for kc in key_chunks:
            if kc > qc:
                continue
            gaps = [p - r for p in range(qc * chunk, (qc + 1) * chunk) for r in range(kc * chunk, (kc + 1) * chunk)]
            outside += not any(0 <= gap < window for gap in gaps)
    return outside


@pytest.mark.parametrize("cp", [2, 4])
def test_blocks_outside_the_window_are_skipped_not_computed(cp2_spawn, cp4_spawn, cp):
    """The blocks each rank skipped equal the chunk pairs the window hides entirely (ring: every
    rank's chunks against every rank's; all-gather: against the gathered sequence), and the
    skipped ones are not computed: computed + skipped = every chunk pair at or before its queries."""
    per_rank = {2: cp2_spawn, 4: cp4_spawn}[cp]
    for index, (shape, window, _, starts) in enumerate(WINDOW_CASES):
        chunk = shape[3] // (2 * cp)
        if not window or starts is not None or shape[3] % (2 * cp):
            continue
        for rank, (_, (_, counts)) in enumerate(per_rank):
            mine = (rank, 2 * cp - 1 - rank)
            want = _chunk_pairs_outside(window, chunk, mine, range(2 * cp))
            pairs = sum(kc <= qc for qc in mine for kc in range(2 * cp))
            for method in ("ring", "allgather"):
                got = counts[(method, index)]
                assert got.get("outside_window", 0) == want, (method, index, rank, got, want)
                assert got["computed"] + got.get("outside_window", 0) == pairs, (method, index, rank, got)
    # Some steps compute nothing at all: at cp4 with a 4-token window, rank 0 (chunks 0 and 7)
    # sees only its own chunks and chunk 6 (rank 1): the steps with ranks 2 and 3 are skipped whole.
    from fivefold.parallel.context.ring import ring_step_blocks
    from fivefold.models.attention.windows import trim_to_window

    for src, computed in ((0, 2), (3, 0), (2, 0), (1, 1)):
        kept = [b for b in ring_step_blocks(0, src, 4, 4, 4) if trim_to_window(b, 4)[0] is not None]
        assert len(kept) == computed, (src, kept)


def test_window_trim_keeps_exactly_the_visible_pairs():
    """For blocks at every offset and windows of every size, the trimmed block with its mask
    shows exactly the pairs the window allows, and every pair it cuts off is hidden."""
    from fivefold.models.attention.windows import Block, trim_to_window

    for window in range(1, 12):
        for n_rows, n_cols in ((4, 4), (3, 5), (6, 2)):
            for gap in range(0, 14):  # keys end `gap` positions before the first query
                q_start, k_start = 20, 20 - gap - n_cols
                block = Block(slice(2, 2 + n_rows), slice(1, 1 + n_cols), False, q_start, k_start)
                i = torch.arange(q_start, q_start + n_rows)[:, None]
                j = torch.arange(k_start, k_start + n_cols)[None, :]
                want = (i - j < window) & (j <= i)
                trimmed, mask = trim_to_window(block, window)
                if trimmed is None:
                    assert not want.any(), (window, gap)
                    continue
                rows = slice(trimmed.rows.start - 2, trimmed.rows.stop - 2)
                cols = slice(trimmed.cols.start - 1, trimmed.cols.stop - 1)
                shown = torch.zeros_like(want)
                shown[rows, cols] = True if mask is None else mask[0]
                assert torch.equal(shown, want), (window, n_rows, n_cols, gap)
                assert trimmed.k_start == k_start + cols.start
            causal = Block(slice(0, 5), slice(0, 5), True, 8, 8)
            _, mask = trim_to_window(causal, window)
            band = torch.ones(5, 5, dtype=torch.bool).tril() & ~torch.ones(5, 5, dtype=torch.bool).tril(-window)
            assert (mask is None and window >= 5) or torch.equal(mask[0], band), window


@pytest.mark.parametrize("window, chunk", [(4, 8), (8, 4), (16, 16), (32, 16), (48, 32), (64, 16), (3, 6)])
def test_window_tiles_cover_each_visible_pair_once(window, chunk):
    """The unmasked tiles of a chunk-pair block (same chunk, the chunks before it) show each
    window-visible pair exactly once and nothing else, mirrored tiles read as their mask says."""
    from fivefold.models.attention.windows import Block, window_tiles

    q_index = 5
    for k_index in range(q_index + 1):
        block = Block(slice(chunk, 2 * chunk), slice(3, 3 + chunk), k_index == q_index,
                      q_index * chunk, k_index * chunk)
        tiles = window_tiles(block, window)
        assert tiles is not None
        i = torch.arange(block.q_start, block.q_start + chunk)[:, None]
        j = torch.arange(block.k_start, block.k_start + chunk)[None, :]
        want = ((i - j < window) & (j <= i)).int()
        shown = torch.zeros_like(want)
        for tile in tiles:
            n_rows, n_cols = tile.rows.stop - tile.rows.start, tile.cols.stop - tile.cols.start
            a, b = torch.arange(n_rows)[:, None], torch.arange(n_cols)[None, :]
            seen = (b >= a) if tile.mirrored else (b <= a) if tile.causal else torch.ones(n_rows, n_cols, dtype=torch.bool)
            assert tile.q_start - block.q_start == tile.rows.start - block.rows.start
            shown[tile.rows.start - chunk:tile.rows.stop - chunk, tile.cols.start - 3:tile.cols.stop - 3] += seen.int()
        assert torch.equal(shown, want), (window, chunk, k_index)
    assert window_tiles(Block(slice(0, 24), slice(0, 24), True, 24, 24), 9) is None  # gcd 3: masked instead


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
