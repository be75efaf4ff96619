"""The output layer fused with its cross-entropy (models/loss/linear_cross_entropy.py) equals F.linear then
F.cross_entropy on fp32 logits: the summed loss and the gradients of the hidden states and the
weight, fp32 and bf16 (an fp32 weight under a bf16 computation, as autocast runs it), with ignored
positions and ragged chunks, on one process and vocabulary-parallel over 2 ranks; the model returns
it given targets; and its peak memory beyond its inputs stays a small fraction of the whole fp32
logits, which the unfused losses exceed (benchmarks/loss_memory.py, in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fivefold.models.loss.cross_entropy import IGNORE
from fivefold.models.loss.linear_cross_entropy import OutputLayer, linear_cross_entropy
from ranks import run_on_ranks

REPO = Path(__file__).resolve().parents[1]
TOKENS, DIM, VOCAB = 37, 8, 50  # chunks of 5 tokens leave a ragged last one


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, TOKENS, DIM, generator=g).to(dtype)
    weight = torch.randn(VOCAB, DIM, generator=g)  # fp32, as a master weight under autocast
    targets = torch.randint(0, VOCAB, (1, TOKENS), generator=g)
    targets[0, ::4] = IGNORE
    return x, weight, targets


def _plain(x, weight, targets, scale=0.7):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = F.linear(x, weight.to(x.dtype))
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    (loss * scale).backward()
    return loss.detach(), x.grad, weight.grad


def _fused(x, weight, targets, scale=0.7, chunk=5, shard=None):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(x, weight, targets, shard=shard, chunk=chunk)
    (loss * scale).backward()
    return loss.detach(), x.grad, weight.grad


def test_fp32_equals_linear_then_cross_entropy():
    want_loss, want_x, want_w = _plain(*_inputs(torch.float32))
    got_loss, got_x, got_w = _fused(*_inputs(torch.float32))
    assert got_loss.dtype == torch.float32
    assert torch.allclose(got_loss, want_loss, rtol=1e-6), (got_loss, want_loss)
    assert (got_x - want_x).abs().max() <= 1e-5
    assert (got_w - want_w).abs().max() <= 1e-5
    assert (got_x[0, ::4] == 0).all()  # positions without a target get no gradient


def test_bf16_equals_it_to_the_roundings_of_bf16():
    """In bf16 the logits are rounded as the output layer rounds them, so the loss is the same; the
    gradients differ by the bf16 rounding of each product (the fused weight gradient sums the
    chunks' products in fp32, the plain one rounds the whole product once): within a few units of
    bf16's 2^-8 relative to the largest gradient entry."""
    want_loss, want_x, want_w = _plain(*_inputs(torch.bfloat16))
    got_loss, got_x, got_w = _fused(*_inputs(torch.bfloat16))
    assert torch.allclose(got_loss, want_loss, rtol=1e-6), (got_loss, want_loss)
    assert got_x.dtype == torch.bfloat16 and got_w.dtype == torch.float32
    for got, want in ((got_x.float(), want_x.float()), (got_w, want_w)):
        assert (got - want).abs().max() <= 4 * 2 ** -8 * want.abs().max()


def test_chunking_does_not_change_the_result():
    whole = _fused(*_inputs(torch.float32), chunk=TOKENS)
    for chunk in (1, 5, 36):
        for got, want in zip(_fused(*_inputs(torch.float32), chunk=chunk), whole):
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


def test_the_output_layer_gives_logits_or_the_summed_loss():
    x, weight, targets = _inputs(torch.float32)
    layer = OutputLayer(DIM, VOCAB)
    with torch.no_grad():
        layer.weight.copy_(weight)
    assert torch.equal(layer(x), F.linear(x, weight))
    want_loss, _, _ = _plain(x, weight, targets)
    assert torch.allclose(layer(x, targets), want_loss, rtol=1e-6)


# --- vocabulary-parallel, 2 ranks ----------------------------------------------------------------

def vocab_parallel_rank(dtype_name: str) -> dict:
    import torch.distributed as dist

    from fivefold.parallel.vocab_shard import VocabShard

    rank, size = dist.get_rank(), dist.get_world_size()
    x, weight, targets = _inputs(getattr(torch, dtype_name))
    rows = VOCAB // size
    shard = VocabShard(rank * rows, dist.group.WORLD.group_name)
    loss, grad_x, grad_w = _fused(x, weight[rank * rows:(rank + 1) * rows], targets, shard=shard)
    dist.all_reduce(grad_x)  # each rank's share of the input's gradient, as a column-split layer sums it
    want_loss, want_x, want_w = _plain(x, weight, targets)
    return {"loss": float(loss), "want_loss": float(want_loss), "grad_x": grad_x.float(), "want_x": want_x.float(),
            "grad_w": grad_w, "want_w": want_w[rank * rows:(rank + 1) * rows]}


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_vocab_parallel_equals_linear_then_cross_entropy(dtype_name):
    bound = 1e-5 if dtype_name == "float32" else None
    for got in run_on_ranks(2, vocab_parallel_rank, dtype_name, timeout_s=120):
        assert abs(got["loss"] - got["want_loss"]) <= 1e-6 * abs(got["want_loss"])
        for name in ("x", "w"):
            want = got[f"want_{name}"]
            limit = bound if bound is not None else 4 * 2 ** -8 * float(want.abs().max())
            assert (got[f"grad_{name}"] - want).abs().max() <= limit, name


# --- memory ---------------------------------------------------------------------------------------

def _measure(loss: str, dtype: str) -> dict:
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "loss_memory.py"), "--one", loss,
                          "--dtype", dtype, "--tokens", "1024", "--vocab", "32768", "--json"],
                         capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_step_adds_a_fraction_of_the_fp32_logits(dtype):
    """The fused loss's forward and backward add at most 0.35x the whole fp32 logits to the peak
    resident memory beyond h and W; the chunked loss of logits (the logits themselves) adds more."""
    fused = _measure("fused", dtype)
    assert fused["beyond_inputs_over_fp32_logits"] <= 0.35, fused
    chunked = _measure("chunked", dtype)
    assert chunked["beyond_inputs_over_fp32_logits"] > 0.35, chunked
    assert fused["value"] == pytest.approx(chunked["value"], rel=1e-6)
