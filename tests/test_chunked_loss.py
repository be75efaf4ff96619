"""The chunked cross-entropy (models/loss/cross_entropy.py, parallel/loss.py) equals F.cross_entropy on
fp32 logits: loss and gradient, fp32 and bf16, mean and loss-mask sum, with ignored positions, on
one process and vocabulary-parallel over 2 tp ranks; and the loss's extra peak memory stays a
fraction of the whole fp32 logits (benchmarks/loss_memory.py, in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fivefold.models.loss.cross_entropy import IGNORE, chunked_cross_entropy
from fivefold.parallel.loss import LMLoss, cross_entropy, lm_loss
from ranks import run_on_ranks

REPO = Path(__file__).resolve().parents[1]
TOKENS, VOCAB = 37, 50  # 37 tokens: chunks of 5 leave a ragged last one


def _inputs(dtype, seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(1, TOKENS, VOCAB, generator=g) * 3).to(dtype)
    labels = torch.randint(0, VOCAB, (1, TOKENS), generator=g)
    if ignore:
        labels[0, ::4] = IGNORE
    return logits, labels


def _plain(logits, labels, reduction="mean"):
    leaf = logits.detach().clone().requires_grad_()
    loss = F.cross_entropy(leaf.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction=reduction)
    loss.backward()
    return loss.detach(), leaf.grad


def _chunked(logits, labels, reduction="mean", overwrite=False, chunk=5, through_op=True):
    leaf = logits.detach().clone().requires_grad_()
    made = leaf * 1 if through_op else leaf  # a non-leaf, as a model's output is
    loss = chunked_cross_entropy(made, labels, reduction, chunk=chunk, overwrite=overwrite)
    loss.backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_fp32_equals_plain(reduction, overwrite):
    logits, labels = _inputs(torch.float32)
    want_loss, want_grad = _plain(logits, labels, reduction)
    got_loss, got_grad = _chunked(logits, labels, reduction, overwrite)
    assert torch.allclose(got_loss, want_loss, rtol=1e-6, atol=1e-6), (got_loss, want_loss)
    assert (got_grad - want_grad).abs().max() <= 1e-6
    assert (got_grad[0, ::4] == 0).all()  # ignored positions get no gradient


@pytest.mark.parametrize("overwrite", [False, True])
def test_bf16_equals_plain_within_rounding(overwrite):
    logits, labels = _inputs(torch.bfloat16)
    want_loss, want_grad = _plain(logits, labels)
    got_loss, got_grad = _chunked(logits, labels, overwrite=overwrite)
    assert got_grad.dtype == torch.bfloat16
    assert torch.allclose(got_loss, want_loss, rtol=1e-6, atol=1e-6)  # fp32 arithmetic on the same values
    # Both are an fp32 gradient rounded once to bf16: at most one bf16 step apart.
    step = want_grad.float().abs().clamp(min=2 ** -126) * 2 ** -7
    assert ((got_grad.float() - want_grad.float()).abs() <= step).all()


def test_overwrite_writes_the_gradient_into_the_logits():
    logits, labels = _inputs(torch.float32)
    _, want_grad = _plain(logits, labels)
    leaf = logits.clone().requires_grad_()
    made = leaf * 1
    seen = []
    made.register_hook(lambda g: seen.append(g.data_ptr() == made.data_ptr()))
    chunked_cross_entropy(made, labels, chunk=5, overwrite=True).backward()
    assert seen == [True]
    assert torch.allclose(made.detach(), want_grad, atol=1e-6)
    # A leaf is never overwritten.
    leaf2 = logits.clone().requires_grad_()
    chunked_cross_entropy(leaf2, labels, chunk=5, overwrite=True).backward()
    assert torch.equal(leaf2.detach(), logits)
    assert torch.allclose(leaf2.grad, want_grad, atol=1e-6)


def test_another_reader_of_overwritten_logits_fails_loudly():
    logits, labels = _inputs(torch.float32)
    made = logits.clone().requires_grad_() * 1
    also = made.sin()  # saves `made` for its own backward
    loss = chunked_cross_entropy(made, labels, chunk=5, overwrite=True)
    with pytest.raises(RuntimeError, match="inplace"):
        (loss + also.sum()).backward()


def test_lm_loss_and_loss_mask_scale():
    logits, labels = _inputs(torch.float32)
    future = torch.stack([labels, labels.roll(1, 1)], dim=-1)  # MTP's labels: the first column counts
    want, _ = _plain(logits, labels)
    assert torch.allclose(lm_loss(logits, future), want, atol=1e-6)
    loss_fn = LMLoss()
    want_sum, want_grad = _plain(logits, labels, "sum")
    leaf = logits.clone().requires_grad_()
    with loss_fn.scaled_by(0.25):
        got = loss_fn(leaf * 1, labels)
    got.backward()
    assert torch.allclose(got, want_sum * 0.25, rtol=1e-6)
    assert (leaf.grad - want_grad * 0.25).abs().max() <= 1e-6
    assert torch.allclose(loss_fn(logits, labels), want, atol=1e-6)  # outside the block: plain text again


def test_no_grad_and_default_chunks():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 300, 64, generator=g)
    labels = torch.randint(0, 64, (2, 300), generator=g)
    with torch.no_grad():
        got = cross_entropy(logits, labels)
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    assert torch.allclose(got, want, rtol=1e-6)


# --- vocabulary-parallel, 2 tp ranks -------------------------------------------------------------

def vocab_parallel_rank(dtype_name: str, reduction: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))["tp"]
    dtype = getattr(torch, dtype_name)
    logits, labels = _inputs(dtype, ignore=True)
    local_vocab = VOCAB // size
    leaf = logits[..., rank * local_vocab:(rank + 1) * local_vocab].clone().requires_grad_()
    sharded = DTensor.from_local(leaf * 1, mesh, [Shard(-1)], run_check=False)
    loss = cross_entropy(sharded, labels, reduction, overwrite=True)
    loss.backward()
    want_loss, want_grad = _plain(logits, labels, reduction)
    return {"loss": float(loss), "want_loss": float(want_loss),
            "grad": leaf.grad.float(), "want_grad": want_grad[..., rank * local_vocab:(rank + 1) * local_vocab].float()}


@pytest.mark.parametrize("dtype_name,reduction", [("float32", "mean"), ("float32", "sum"), ("bfloat16", "mean")])
def test_vocab_parallel_equals_plain(dtype_name, reduction):
    for got in run_on_ranks(2, vocab_parallel_rank, dtype_name, reduction, timeout_s=120):
        assert abs(got["loss"] - got["want_loss"]) <= 1e-6 * max(1.0, abs(got["want_loss"]))
        if dtype_name == "float32":
            assert (got["grad"] - got["want_grad"]).abs().max() <= 1e-6
        else:
            step = got["want_grad"].abs().clamp(min=2 ** -126) * 2 ** -7
            assert ((got["grad"] - got["want_grad"]).abs() <= step).all()


# --- memory ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_extra_peak_memory_is_a_fraction_of_the_fp32_logits(dtype):
    """benchmarks/loss_memory.py in a fresh process: the chunked loss's forward and backward add at
    most 0.35x the whole fp32 logits to the peak resident memory."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "loss_memory.py"), "--one", "chunked",
                          "--dtype", dtype, "--tokens", "1024", "--vocab", "32768", "--json"],
                         capture_output=True, text=True, env=env, timeout=300, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["extra_over_fp32_logits"] <= 0.35, result
