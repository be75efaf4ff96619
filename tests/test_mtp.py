"""Multi-token prediction (models/mtp.py) against its definition (DeepSeek-V3 section 2.2), in one
process: the targets of each depth, the gradients of LM loss + weight/D · sum of depth losses written
out by hand, evaluation without it, and what is refused. Its layouts are those of the deepseek_v3
family (tests/test_families.py, tests/test_composition.py: tiny-deepseek-v3 has one MTP block)."""

import pytest
import torch
import torch.nn.functional as F

from fivefold.config import ConfigError
from fivefold.configure import load_config, validate
from fivefold.models import build_model
from fivefold.models.mtp import IGNORE, future_tokens


def test_future_tokens_are_the_tokens_ahead():
    windows = torch.arange(10).view(2, 5)  # two windows of seq 4 (+1 label)
    future = future_tokens(windows, depth=2)
    assert future.shape == (2, 4, 3)
    assert future[0].tolist() == [[1, 2, 3], [2, 3, 4], [3, 4, IGNORE], [4, IGNORE, IGNORE]]
    assert torch.equal(future[..., 0], windows[:, 1:])  # column 0: the LM labels


def _model(depth: int, weight: float):
    cfg = load_config(None, {"model": {"preset": "tiny-deepseek-v3", "n_layers": 2, "mtp_depth": depth,
                                       "mtp_loss_weight": weight}}).model
    return build_model(cfg, seed=1)


@pytest.mark.parametrize("depth", [1, 2])
def test_gradients_are_those_of_the_written_out_objective(depth):
    """LM loss + weight/D · sum_k CE_k, with block k fed the previous depth's hidden state (the main
    model's last-layer output first) and the embedding of the token k ahead, predicting k+1 ahead."""
    weight = 0.3
    model = _model(depth, weight)
    windows = torch.randint(0, model.cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    inputs, future = windows[:, :-1], future_tokens(windows, depth)
    lm = model(inputs, targets=future) / future[..., 0].numel()  # the summed LM cross-entropy's mean
    lm.backward()
    recorded = [model.layers[str(model.cfg.n_layers + k)].take_losses() for k in range(depth)]
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    model, kept = _model(depth, weight), {}  # the same weights, written out
    model.norm.register_forward_pre_hook(lambda module, args: kept.update(h=args[0]))  # returns None: no change
    logits = model(inputs)  # no MTP without targets
    h, total = kept["h"], F.cross_entropy(logits.flatten(0, 1), future[..., 0].flatten())
    cos, sin = model.rope_tables(torch.arange(inputs.shape[1])[None])
    for k in range(1, depth + 1):
        block = model.layers[str(model.cfg.n_layers + k - 1)]
        joined = torch.cat((block.enorm(model.tok_embeddings(future[..., k - 1].clamp(min=0))), block.hnorm(h)), -1)
        h = block.attention_branch(block.eh_proj(joined), cos, sin) + block.eh_proj(joined)
        h = h + block.feed_forward_branch(h)
        targets = future[..., k]
        per_position = F.cross_entropy(model.output(block.head_norm(h)).flatten(0, 1), targets.flatten(),
                                       ignore_index=IGNORE, reduction="none")
        depth_loss = per_position.sum() / targets.numel()  # positions past the window count as 0
        assert recorded[k - 1] == [pytest.approx(depth_loss.item(), rel=1e-6)]
        total = total + weight / depth * depth_loss
    total.backward()
    for name, param in model.named_parameters():
        assert torch.allclose(got[name], param.grad, rtol=1e-5, atol=1e-7), (name, (got[name] - param.grad).abs().max())
    assert got[f"layers.{model.cfg.n_layers}.eh_proj.weight"].abs().sum() > 0


def test_weight_zero_leaves_the_lm_gradients_and_evaluation_skips_it():
    with_mtp, without = _model(1, 0.0), _model(0, 0.0)
    windows = torch.randint(0, with_mtp.cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    for model in (with_mtp, without):
        model(windows[:, :-1], targets=future_tokens(windows, 1)[..., : 1 + model.cfg.mtp_depth]).backward()
    shared = dict(without.named_parameters())
    for name, param in with_mtp.named_parameters():
        if name in shared:
            assert torch.equal(param.grad, shared[name].grad), name
    assert len(with_mtp.layers["2"].take_losses()) == 1  # the training forward's
    with torch.no_grad():  # evaluation: the LM loss only, and nothing recorded
        assert torch.equal(with_mtp(windows[:, :-1], targets=future_tokens(windows, 1)),
                           without(windows[:, :-1], targets=windows[:, 1:]))
    assert with_mtp.layers["2"].take_losses() == []


def test_mtp_needs_a_family_with_it():
    cfg = load_config(None, {"model": {"preset": "tiny", "mtp_depth": 1}})
    with pytest.raises(ConfigError, match="model.mtp_depth=1 needs a family with multi-token prediction"):
        validate(cfg)  # the one gate the planner calls too


def test_tied_embeddings_refuse_split_backward_schedules():
    """The last stage reads the tied matrix three times; torch's split weight pass fails on it
    (measured: pp2 zb and zbv stop with 'backward through the graph a second time')."""
    tied = {"preset": "tiny-deepseek-v3", "n_kv_heads": 4, "tie_embeddings": True}
    for schedule in ("zb", "zbv", "dualpipev"):
        cfg = load_config(None, {"model": tied, "parallel": {"pp": 2, "pp_schedule": schedule, "pp_virtual": 2},
                                 "train": {"micro_batch": 1}})
        with pytest.raises(ConfigError, match=f"pp_schedule='{schedule}' cannot run multi-token prediction"):
            validate(cfg, 2)
    validate(load_config(None, {"model": tied, "parallel": {"pp": 2}, "train": {"micro_batch": 1}}), 2)  # 1f1b runs
