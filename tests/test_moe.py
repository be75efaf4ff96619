"""The MoE layer against direct, token-by-token computations: routing, experts, capacity, balancing."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from fivefold.config import ModelConfig, MoEConfig
from fivefold.models import build_model
from fivefold.models.moe import layer as moe_module
from fivefold.models.loss.weight import micro_batch_weight
from fivefold.models.moe.layer import MoE, capacity_keep, looped_swiglu, moe_layers, sequence_aux_loss

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


def test_first_grouped_mm_inside_selective_recomputation():
    """The grouped-matmul probe may first run inside a selectively recomputed block: its matmuls
    must not be replayed in place of the block's own (a fresh process training an MoE model with
    recompute = "selective" and no expert parallelism failed in backward with a shape mismatch)."""
    from fivefold.parallel.recompute import _recomputed_selective

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(13, DIM, generator=gen, requires_grad=True)
    ws = [torch.randn(4, *shape, generator=gen, requires_grad=True) for shape in
          ((HIDDEN, DIM), (DIM, HIDDEN), (HIDDEN, DIM))]
    counts = [5, 0, 6, 2]
    moe_module._grouped_mm_works.cache_clear()
    out = _recomputed_selective(True, 0, lambda x: moe_module.grouped_swiglu(x, *ws, counts), x)
    upstream = torch.randn(out.shape, generator=gen)
    recomputed = torch.autograd.grad(out, [x, *ws], upstream)
    plain = torch.autograd.grad(looped_swiglu(x, *ws, counts), [x, *ws], upstream)
    for a, b in zip(recomputed, plain):
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
        with micro_batch_weight(scale):
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


class SimulatedPieces:
    """A cp rank's pieces in one process: `gather` hands back the per-chunk counts of the whole
    sequence, counted directly here (not by the code under test), after checking that the rank's
    own share of them is what it sent."""

    def __init__(self, whole: torch.Tensor, n_experts: int, cp: int, rank: int):
        batch, seq, k = whole.shape
        self.n_chunks, self.chunks = 2 * cp, [rank, 2 * cp - 1 - rank]  # parallel/context/apply.py's split
        chunk = seq // self.n_chunks
        self.counts = torch.zeros(self.n_chunks, batch, k, n_experts, dtype=torch.long)
        for c in range(self.n_chunks):
            for e in range(n_experts):
                self.counts[c, :, :, e] = (whole[:, c * chunk:(c + 1) * chunk] == e).sum(1)
        self.local = torch.cat([whole[:, c * chunk:(c + 1) * chunk] for c in self.chunks], 1)

    def gather(self, local_counts: torch.Tensor) -> torch.Tensor:
        assert torch.equal(local_counts, self.counts[self.chunks])
        return self.counts

    def total(self, t: torch.Tensor) -> torch.Tensor:
        return t  # capacity is what these tests check; the cp sum of the auxiliary loss is tests/test_context_parallel.py's


def skewed_choices(batch=3, seq=24, k=2, n_experts=4, seed=0) -> torch.Tensor:
    """k distinct experts per token, expert 0 popular, so capacity drops many assignments."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.tensor([0.55, 0.25, 0.12, 0.08]).expand(batch * seq, n_experts)
    return torch.multinomial(probs, k, generator=gen).view(batch, seq, k)


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("capacity", [12, 6])  # capacity factors 1.0 and 0.5 of seq 24, top-2, 4 experts
def test_capacity_on_pieces_is_the_whole_sequence_decision(cp, capacity):
    whole = skewed_choices()
    want = capacity_keep(whole, 4, capacity)
    chunk = whole.shape[1] // (2 * cp)
    got = torch.zeros_like(want)
    local_differs = False
    for rank in range(cp):
        pieces = SimulatedPieces(whole, 4, cp, rank)
        keep = capacity_keep(pieces.local, 4, capacity, pieces)
        for i, c in enumerate(pieces.chunks):
            got[:, c * chunk:(c + 1) * chunk] = keep[:, i * chunk:(i + 1) * chunk]
        # What a rank would decide alone (its pieces as a sequence, capacity scaled to them).
        alone = capacity_keep(pieces.local, 4, math.ceil(capacity * 2 / (2 * cp)))
        local_differs |= not torch.equal(alone, keep)
    assert torch.equal(got, want)
    assert (~want).sum() > 0 and local_differs  # drops happen, and rank-local priority would differ


def test_moe_with_pieces_uses_the_whole_sequence_capacity():
    """The layer on one rank's pieces (capacity from the whole length) computes what the whole
    sequence computes at those positions."""
    layer = make_moe(capacity_factor=0.5)
    x = inputs(seq=16)
    whole_out = layer(x)
    _, indices, _ = layer.router(x.reshape(-1, DIM))
    for rank in range(2):
        pieces = SimulatedPieces(indices.view(3, 16, 2), 4, cp=2, rank=rank)
        positions = torch.cat([torch.arange(c * 4, (c + 1) * 4) for c in pieces.chunks])
        layer.split_sequences(over_ranks=pieces)
        torch.testing.assert_close(layer(x[:, positions]), whole_out[:, positions], atol=1e-6, rtol=0)
    layer.sequence_split = None
    layer.take_stats()
    layer(x)
    assert layer.take_stats().dropped > 0


def test_ignored_expert_is_warned_once_and_layers_are_reported(monkeypatch, capsys, tmp_path):
    """A tiny MoE run whose routers never choose expert 3 (a huge negative choice bias, set again
    before every forward): rank 0 warns once per layer after log.dead_expert_steps idle steps;
    the per-layer figures add up to the totals, in the records, metrics.jsonl and the TensorBoard tags."""
    import json

    from layouts import tiny_config

    from fivefold.models.moe.layer import Router
    from fivefold.train.metrics import tensorboard_scalars
    from fivefold.train.trainer import train

    route = Router.forward

    def ignoring_last_expert(self, tokens):
        with torch.no_grad():
            self.expert_bias[-1] = -1e9
        return route(self, tokens)

    monkeypatch.setattr(Router, "forward", ignoring_last_expert)
    moe = {"n_experts": 4, "top_k": 2, "expert_ffn_dim": 64, "balance": "bias", "capacity_factor": 1.0}
    result = train(tiny_config({"model": {"moe": moe}, "log": {"dead_expert_steps": 3, "dir": str(tmp_path)}}))
    records = result.records
    for index, block in result.parallel.model.layers.items():  # the bias after the last step's update
        assert records[-1]["moe_layers"][index]["expert_bias"] == moe_layers(block)[0].router.expert_bias.tolist()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "received no tokens" in line]
    assert len(warnings) == 2, warnings  # once per layer, though expert 3 stays idle for 6 steps
    assert all("expert 3 " in w and "3 steps in a row (step 3)" in w for w in warnings)
    assert {w.split(",")[0] for w in warnings} == {"warning: MoE layer 0", "warning: MoE layer 1"}

    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["moe_layers"] for r in written] == [r["moe_layers"] for r in records]
    for record in records:
        layers = record["moe_layers"]
        assert set(layers) == {"0", "1"}
        loads = [layers[l]["tokens_per_expert"] for l in ("0", "1")]
        assert [a + b for a, b in zip(*loads)] == record["moe_tokens_per_expert"]
        assert all(load[3] == 0 and sum(load) == 8 * 32 * 2 for load in loads)  # every assignment
        assert sum(layers[l]["dropped_tokens"] for l in layers) == record["moe_dropped_tokens"] > 0
        per_layer = [max(load) / (sum(load) / 4) for load in loads]
        assert [layers[l]["imbalance"] for l in ("0", "1")] == pytest.approx(per_layer)
        assert record["moe_imbalance"] == pytest.approx(max(per_layer))
        assert all(layers[l]["expert_bias"][3] < -1e8 and len(layers[l]["expert_bias"]) == 4 for l in layers)
        tags = tensorboard_scalars(record)
        assert tags["moe/layer1/tokens/expert3"] == 0 and tags["moe/layer0/bias/expert3"] < -1e8
        assert tags["moe/layer0/imbalance"] == layers["0"]["imbalance"]
        assert tags["moe_dropped_tokens"] == record["moe_dropped_tokens"]


def test_dead_expert_watch_counts_steps_in_a_row():
    from fivefold.train.metrics import DeadExpertWatch

    def record(step, tokens):
        return {"step": step, "moe_layers": {"2": {"tokens_per_expert": tokens}}}

    watch = DeadExpertWatch(2)
    said = [watch.update(record(s, t)) for s, t in enumerate([[0, 5], [4, 0], [0, 0], [0, 0], [3, 0]], 1)]
    # Expert 0 idle at step 1, busy at 2, idle from 3: said at 4; expert 1 idle from 2: said at 3, once.
    assert [len(lines) for lines in said] == [0, 0, 1, 1, 0]
    assert "layer 2, expert 1 " in said[2][0] and "layer 2, expert 0 " in said[3][0]
    assert DeadExpertWatch(0).update(record(1, [0, 0])) == []  # off


@pytest.mark.parametrize("model", [{"moe": {"n_experts": 4, "top_k": 2, "aux_loss_coeff": 0.5}},
                                   {"preset": "tiny-deepseek-v3", "n_layers": 2, "n_kv_heads": 4, "mtp_depth": 1,
                                    "mtp_loss_weight": 0.5}],
                         ids=["moe aux loss", "deepseek aux loss and mtp"])
def test_added_losses_weigh_as_each_micro_batch(model):
    """Gradient accumulation: 4 micro-batches of 2 give the step of one batch of 8, the losses the model
    adds beside the LM loss included (the MoE auxiliary loss, multi-token prediction). They reach the
    gradients inside the model, so they must weigh 1/4 per micro-batch as the LM loss does
    (models/loss/weight.py). Fixed bounds, not the harness's measured noise: that noise is measured by
    changing the micro-batch split, the very thing under test."""
    from layouts import run_layout

    train = {"steps": 3, "lr": 1e-2}
    whole = run_layout({"model": model, "train": {**train, "micro_batch": 8}})
    split = run_layout({"model": model, "train": {**train, "micro_batch": 2}})
    for step, (a, b) in enumerate(zip(split.grad_norms, whole.grad_norms), 1):
        assert a == pytest.approx(b, rel=1e-5), f"step {step} grad norm"
    # AdamW's m/sqrt(v) lifts the split's reassociation to 7.7e-5 on a few latent-attention weights
    # (lr 1e-2); weighing the added losses 1 instead of 1/4 moves the gradient norm 1.6-2x.
    for name, tensor in whole.weights.items():
        assert (split.weights[name] - tensor).abs().max().item() <= 3e-4, name
