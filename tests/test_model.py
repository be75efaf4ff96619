"""The dense model against direct formulas: shapes, causality, RoPE, llama3 scaling, GQA, init, tying."""

import dataclasses
import math

import pytest
import torch

from fivefold.config import ModelConfig
from fivefold.models import build_model
from fivefold.models.decoder import CausalAttention, apply_rope, rope_inverse_frequencies

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128,
                  tie_embeddings=False)


def tokens(batch=2, seq=12, seed=0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=0).eval()


def test_logits_shape(model):
    with torch.no_grad():
        assert model(tokens(3, 5)).shape == (3, 5, CFG.vocab_size)


def test_causal_later_tokens_do_not_change_earlier_logits(model):
    x = tokens()
    y = x.clone()
    y[:, 7] = (y[:, 7] + 1) % CFG.vocab_size
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :7], b[:, :7], atol=1e-6, rtol=0)
    assert (a[:, 7:] - b[:, 7:]).abs().amax(dim=-1).min() > 1e-4  # and the later ones do change


def test_rope_rotates_each_half_pair_by_pos_times_frequency(model):
    # Direct formula, in float64: pair (x_i, x_{i+d/2}) turns by pos * theta^(-2i/d).
    d, theta = CFG.head_dim, CFG.rope_theta
    positions = torch.tensor([[0, 1, 5, 37, 100]])
    x = torch.randn(1, 3, positions.shape[1], d, generator=torch.Generator().manual_seed(1))
    cos, sin = model.rope_tables(positions)
    got = apply_rope(x, cos, sin)
    want = torch.empty_like(x, dtype=torch.float64)
    for s, pos in enumerate(positions[0].tolist()):
        for i in range(d // 2):
            angle = pos * theta ** (-2 * i / d)
            a, b = x[..., s, i].double(), x[..., s, i + d // 2].double()
            want[..., s, i] = a * math.cos(angle) - b * math.sin(angle)
            want[..., s, i + d // 2] = a * math.sin(angle) + b * math.cos(angle)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)


def test_llama3_frequency_scaling_piecewise():
    cfg = dataclasses.replace(CFG, rope_scaling=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                              rope_original_max_seq_len=64)
    d = cfg.head_dim
    regimes = set()
    want = []
    for i in range(d // 2):
        freq = cfg.rope_theta ** (-2 * i / d)
        wavelen = 2 * math.pi / freq
        short, long = 64 / 4.0, 64 / 1.0  # original context / high and low frequency factors
        if wavelen < short:
            regimes.add("kept")
            want.append(freq)
        elif wavelen > long:
            regimes.add("slowed")
            want.append(freq / 8.0)
        else:
            regimes.add("interpolated")
            smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
            want.append((1 - smooth) * freq / 8.0 + smooth * freq)
    assert regimes == {"kept", "slowed", "interpolated"}  # the config exercises every branch
    torch.testing.assert_close(rope_inverse_frequencies(cfg).double(), torch.tensor(want, dtype=torch.float64),
                               atol=0, rtol=1e-6)
    assert torch.equal(rope_inverse_frequencies(dataclasses.replace(cfg, rope_scaling=0.0)),
                       rope_inverse_frequencies(CFG))


def test_gqa_equals_repeated_kv_heads_and_plain_softmax():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 6, 9, 8, generator=gen)
    k, v = torch.randn(2, 3, 9, 8, generator=gen), torch.randn(2, 3, 9, 8, generator=gen)
    got = CausalAttention()(q, k, v)
    # Query head h reads kv head h // (heads / kv_heads): the grouping Hugging Face uses.
    k_rep, v_rep = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(got, CausalAttention()(q, k_rep, v_rep), atol=1e-6, rtol=0)
    scores = q.double() @ k_rep.double().transpose(-1, -2) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(got.double(), scores.softmax(-1) @ v_rep.double(), atol=1e-6, rtol=0)


def test_init_is_a_function_of_seed_name_and_shape():
    a, b, c = (build_model(CFG, seed=s).state_dict() for s in (7, 7, 8))
    for name in a:
        assert torch.equal(a[name], b[name]), name
        if "norm" not in name:
            assert not torch.equal(a[name], c[name]), name
    # Parameters of the same shape still get their own draws (the generator is keyed by name).
    assert not torch.equal(a["layers.0.attention.wq.weight"], a["layers.1.attention.wq.weight"])
    assert not torch.equal(a["layers.0.feed_forward.w1.weight"], a["layers.0.feed_forward.w3.weight"])
    # Another layer count leaves every shared, non-residual-scaled parameter as it was: what lets a
    # pipeline stage or a shard build only its part and still get the single-process values.
    deeper = build_model(dataclasses.replace(CFG, n_layers=3), seed=7).state_dict()
    assert torch.equal(deeper["layers.1.attention.wq.weight"], a["layers.1.attention.wq.weight"])
    assert torch.equal(deeper["tok_embeddings.weight"], a["tok_embeddings.weight"])


def test_tied_embeddings_share_storage():
    tied = build_model(dataclasses.replace(CFG, tie_embeddings=True), seed=0)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert len(list(tied.parameters())) == len(list(build_model(CFG, seed=0).parameters())) - 1
    untied = build_model(CFG, seed=0)
    assert untied.output.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()


def test_positions_argument(model):
    x = tokens(seq=10)
    with torch.no_grad():
        default = model(x)
        # Explicit 0..seq-1 is the default, bit for bit.
        assert torch.equal(model(x, positions=torch.arange(10)[None]), default)
        # RoPE only sees position differences: shifting every position leaves logits unchanged (up to
        # the rounding of larger angles), per batch row as well as for the whole batch.
        torch.testing.assert_close(model(x, positions=torch.arange(10)[None] + 5), default, atol=1e-4, rtol=0)
        per_row = torch.stack([torch.arange(10) + 3, torch.arange(10) + 11])
        torch.testing.assert_close(model(x, positions=per_row), default, atol=1e-4, rtol=0)
        # ... but positions are used: spreading them apart changes everything after the first token.
        spread = model(x, positions=torch.arange(10)[None] * 3)
    assert torch.equal(spread[:, 0], default[:, 0])  # position 0 in both
    assert (spread[:, 1:] - default[:, 1:]).abs().amax(dim=-1).min() > 1e-4
