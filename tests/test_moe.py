"""The MoE layer against direct, token-by-token computations: routing, experts, capacity, balancing."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from fivefold.config import ModelConfig, MoEConfig
from fivefold.models import build_model
from fivefold.models import moe as moe_module
from fivefold.models.moe import MoE, capacity_keep, looped_swiglu, moe_layers, sequence_aux_loss

DIM, HIDDEN = 16, 24


def make_moe(seed=0, **overrides) -> MoE:
    cfg = dataclasses.replace(MoEConfig(n_experts=4, top_k=2), **overrides)
    layer = MoE(DIM, HIDDEN, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def inputs(batch=3, seq=10, seed=1):
    return torch.randn(batch, seq, DIM, generator=torch.Generator().manual_seed(seed))


def direct_moe(layer: MoE, x: torch.Tensor, keep=None) -> torch.Tensor:
    """Token by token, expert by expert, in float64: the definition of the layer."""
    cfg, e = layer.cfg, layer.experts
    out = torch.zeros(x.shape, dtype=torch.float64)
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            t = x[b, s].double()
            logits = layer.router.gate.weight.double() @ t
            scores = logits.softmax(-1) if cfg.score == "softmax" else logits.sigmoid()
            choice = scores + layer.router.expert_bias.double() if cfg.balance == "bias" else scores
            top = sorted(range(cfg.n_experts), key=lambda i: -choice[i].item())[:cfg.top_k]
            total = sum(scores[i] for i in top) if cfg.top_k > 1 else 1.0
            for slot, i in enumerate(top):
                if keep is not None and not keep[b, s, slot]:
                    continue
                h = F.silu(e.w1[i].double() @ t) * (e.w3[i].double() @ t)
                out[b, s] += scores[i] / total * (e.w2[i].double() @ h)
    return out


@pytest.mark.parametrize("score,balance", [("softmax", "aux_loss"), ("sigmoid", "bias"), ("softmax", "none")])
def test_router_topk_and_renormalisation(score, balance):
    layer = make_moe(score=score, balance=balance)
    if balance == "bias":  # a bias big enough to change the choice but not the weights
        layer.router.expert_bias.copy_(torch.tensor([0.5, 0.0, -0.5, 0.2]))
    x = inputs().reshape(-1, DIM)
    scores, indices, weights = layer.router(x)
    logits = x.double() @ layer.router.gate.weight.double().T
    want_scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    torch.testing.assert_close(scores.double(), want_scores, atol=1e-6, rtol=0)
    choice = want_scores + (layer.router.expert_bias.double() if balance == "bias" else 0)
    want_idx = choice.argsort(-1, descending=True)[:, :2]
    assert torch.equal(indices, want_idx)
    picked = want_scores.gather(-1, want_idx)
    torch.testing.assert_close(weights.double(), picked / picked.sum(-1, keepdim=True), atol=1e-6, rtol=0)


@pytest.mark.parametrize("score,balance,shared", [("softmax", "aux_loss", 0), ("sigmoid", "bias", 1)])
def test_moe_forward_matches_direct(score, balance, shared):
    layer = make_moe(score=score, balance=balance, n_shared_experts=shared)
    layer.router.expert_bias.copy_(torch.tensor([0.1, 0.0, -0.1, 0.05]))
    x = inputs()
    want = direct_moe(layer, x)
    if layer.shared is not None:
        want += layer.shared(x).double()
    torch.testing.assert_close(layer(x).double(), want, atol=1e-5, rtol=0)


def test_grouped_mm_matches_per_expert_loop_forward_and_backward():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(13, DIM, generator=gen, requires_grad=True)
    ws = [torch.randn(4, *shape, generator=gen, requires_grad=True) for shape in
          ((HIDDEN, DIM), (DIM, HIDDEN), (HIDDEN, DIM))]
    counts = [5, 0, 6, 2]  # an empty expert too
    assert moe_module.grouped_mm_usable(x.device, x.dtype, DIM, HIDDEN), "CPU fp32 has torch._grouped_mm"
    grouped = moe_module.grouped_swiglu(x, *ws, counts)
    looped = looped_swiglu(x, *ws, counts)
    torch.testing.assert_close(grouped, looped, atol=1e-5, rtol=1e-5)
    upstream = torch.randn(grouped.shape, generator=gen)
    g1 = torch.autograd.grad(grouped, [x, *ws], upstream)
    g2 = torch.autograd.grad(looped, [x, *ws], upstream)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_fallback_when_grouped_mm_disabled(monkeypatch):
    layer = make_moe()
    x = inputs()
    with_grouped = layer(x)
    monkeypatch.setattr(moe_module, "GROUPED_MM_ENABLED", False)
    torch.testing.assert_close(layer(x), with_grouped, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x).double(), direct_moe(layer, x), atol=1e-5, rtol=0)


def test_capacity_drops_by_priority_and_counts_them():
    layer = make_moe(capacity_factor=0.5)  # ceil(0.5·10·2/4) = 3 assignments per expert per sequence
    x = inputs()
    out = layer(x)
    _, indices, _ = layer.router(x.reshape(-1, DIM))
    indices = indices.view(3, 10, 2)
    keep = torch.ones_like(indices, dtype=torch.bool)
    for b in range(3):  # first choices before second choices, earlier positions first
        taken = [0] * 4
        for slot in range(2):
            for s in range(10):
                e = indices[b, s, slot].item()
                keep[b, s, slot] = taken[e] < 3
                taken[e] += 1
    assert torch.equal(capacity_keep(indices, 4, 3), keep)
    stats = layer.take_stats()
    assert stats.dropped == (~keep).sum().item() > 0
    assert stats.load.tolist() == torch.bincount(indices.reshape(-1), minlength=4).tolist()
    torch.testing.assert_close(out.double(), direct_moe(layer, x, keep), atol=1e-5, rtol=0)


def test_dropless_drops_nothing():
    layer = make_moe(capacity_factor=0.0)
    layer(inputs())
    assert layer.take_stats().dropped == 0


def test_aux_loss_value_against_formula():
    layer = make_moe(aux_loss_coeff=0.01)
    x = inputs()
    layer(x)
    scores, indices, _ = layer.router(x.reshape(-1, DIM))
    scores, indices = scores.view(3, 10, 4).double(), indices.view(3, 10, 2)
    total = 0.0
    for b in range(3):
        f = [sum((indices[b] == e).sum().item() for _ in [0]) / (10 * 2) for e in range(4)]
        p = [scores[b, :, e].mean().item() for e in range(4)]
        total += 4 * sum(fe * pe for fe, pe in zip(f, p))
    assert math.isclose(layer.take_stats().aux_loss, 0.01 * total / 3, rel_tol=1e-5)
    # Perfectly uniform routing gives exactly the coefficient.
    uniform = sequence_aux_loss(torch.full((1, 4, 4), 0.25), torch.tensor([[[0, 1], [2, 3], [0, 1], [2, 3]]]),
                                layer.cfg)
    assert math.isclose(uniform.item(), 0.01, rel_tol=1e-6)


def test_bias_balancing_moves_load_toward_uniform():
    """A router skewed toward expert 0; bias updates from the observed load even it out."""
    layer = make_moe(balance="bias", bias_update_rate=0.02, top_k=1)
    with torch.no_grad():
        layer.router.gate.weight[0] += 0.15  # with inputs shifted by +1, expert 0 wins most tokens
    x = inputs(batch=8, seq=16, seed=5) + 1.0

    def imbalance():
        layer(x)
        load = layer.take_stats().load.float()
        return (load.max() / load.mean()).item(), load

    start, load = imbalance()
    for _ in range(60):
        layer.update_bias(load)
        _, load = imbalance()
    end, _ = imbalance()
    assert start > 2.0 and end < 1.4, (start, end)
    assert layer.router.expert_bias[0] < 0  # the overloaded expert was pushed down


def test_model_layers_first_dense_and_every():
    cfg = ModelConfig(dim=32, n_layers=5, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                      moe=MoEConfig(n_experts=4, top_k=2, first_dense=1, every=2, expert_ffn_dim=16))
    model = build_model(cfg, seed=0)
    kinds = [isinstance(model.layers[str(i)].feed_forward, MoE) for i in range(5)]
    assert kinds == [False, True, False, True, False]
    assert model.layers["1"].feed_forward.experts.w1.shape == (4, 16, 32)
    again = build_model(cfg, seed=0)
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name
    experts = model.layers["1"].feed_forward.experts
    assert not torch.equal(experts.w1[0], experts.w1[1])  # experts start different
    logits = model(torch.randint(0, 64, (2, 8)))
    assert logits.shape == (2, 8, 64)
    assert [m.take_stats().forwards for m in moe_layers(model)] == [1, 1]


def test_aux_loss_gradient_reaches_router_with_its_scale():
    """The layer's output carries the auxiliary loss into backward: d/dθ (out·g) + scale · d/dθ aux."""
    layer = make_moe(aux_loss_coeff=0.1)
    x = inputs()
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(9))
    gate = layer.router.gate.weight

    def gate_grad(scale):
        layer.aux_grad_scale = scale
        return torch.autograd.grad((layer(x) * upstream).sum(), gate)[0]

    scores, indices, _ = layer.router(x.reshape(-1, DIM))
    aux_grad = torch.autograd.grad(sequence_aux_loss(scores.view(3, 10, 4), indices.view(3, 10, 2), layer.cfg), gate)[0]
    assert aux_grad.abs().max() > 1e-4
    torch.testing.assert_close(gate_grad(0.5), gate_grad(0.0) + 0.5 * aux_grad, atol=1e-6, rtol=1e-5)


def test_stats_skip_evaluation_forwards():
    layer = make_moe()
    with torch.no_grad():
        layer(inputs())
    assert layer.take_stats().forwards == 0
