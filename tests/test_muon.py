"""Muon (train.optimizer = muon, train/muon.py): the single-process step is torch.optim.Muon on the
matrices inside the blocks (each expert's matrix on its own) plus AdamW on the rest; every layout
Muon reaches equals the single process; the layouts it does not reach are refused at validation.

One 2-rank spawn runs every layout (zero 0/1/2 in fp32, zero 1 in bf16, an MoE at zero 2)."""

import copy

import pytest
import torch

from layouts import assert_same_run, reference, run_layout, tiny_config
from ranks import run_on_ranks

from fivefold.config import ConfigError

MOE = {"moe": {"n_experts": 4, "top_k": 2, "expert_ffn_dim": 64}}
TRAIN = {"optimizer": "muon", "lr": 0.02, "micro_batch": 2, "steps": 4}


def _muon(model=None, dtype="fp32", **parallel) -> dict:
    return {"model": model or {}, "parallel": parallel, "train": {**TRAIN, "dtype": dtype}}


LAYOUTS = {"dp2 zero0": _muon(dp=2, zero=0), "dp2 zero1": _muon(dp=2, zero=1),
           "dp2 zero2": _muon(dp=2, zero=2), "dp2 zero1 bf16": _muon(dtype="bf16", dp=2, zero=1),
           "moe dp2 zero2": _muon(MOE, dp=2, zero=2)}


def two_ranks() -> dict:
    out = {label: run_layout(layout) for label, layout in LAYOUTS.items()}
    out["shares"] = _shares(_muon(dp=2, zero=1))
    return out


def _shares(layout) -> list[int]:
    from fivefold.train.trainer import setup

    from layouts import groups_released

    with groups_released():
        _, par = setup(tiny_config(layout))
        return par.muon_layout().shares


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(2, two_ranks)


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_layout_matches_the_single_process_muon(runs, label):
    want = reference(LAYOUTS[label])
    for rank, results in enumerate(runs):
        assert_same_run(results[label], want, label=f"muon {label} rank {rank}")


def test_matrices_are_spread_evenly_over_the_ranks(runs):
    """Each matrix is orthogonalised on one rank; the Newton–Schulz flops split within 20%."""
    shares = runs[0]["shares"]
    assert len(shares) == 2 and min(shares) >= 0.8 * max(shares), shares
    assert runs[1]["shares"] == shares


def test_muon_trains_differently_from_adamw():
    assert reference(LAYOUTS["dp2 zero1"]).losses != reference({"train": {**TRAIN, "optimizer": "adamw"}}).losses


@pytest.mark.parametrize("model", [{}, MOE], ids=["dense", "moe"])
def test_a_step_equals_torch_muon_and_adamw(model):
    """Two steps of fivefold's optimizer on the single process against torch.optim.Muon on every
    block matrix (each expert's alone) and torch's AdamW on the rest, same groups: within 1e-6."""
    from fivefold.train.optim import build_optimizer
    from fivefold.train.trainer import setup

    cfg = tiny_config({"model": model, "train": {**TRAIN, "muon_adjust_lr": "match_rms_adamw"}})
    _, par = setup(cfg)
    params = dict(par.parts[0].named_parameters())
    ours = build_optimizer(params.values(), par.settings_of, cfg.train, par.muon_layout())
    theirs = {n: p.detach().clone() for n, p in params.items()}
    muon, adam = [], {}
    for name, param in params.items():
        settings = par.settings_of(param)
        if settings.optimizer == "muon":  # an expert stack: one torch tensor per expert
            pieces = [theirs[name]] if param.dim() == 2 else [theirs[name][i] for i in range(param.shape[0])]
            muon += [(name, i, torch.nn.Parameter(t.clone())) for i, t in enumerate(pieces)]
        else:
            adam.setdefault(settings.weight_decay, []).append((name, torch.nn.Parameter(theirs[name])))
    assert muon and adam
    t = cfg.train
    torch_muon = torch.optim.Muon([p for _, _, p in muon], lr=t.lr, weight_decay=t.weight_decay,
                                  momentum=t.muon_momentum, adjust_lr_fn="match_rms_adamw")
    torch_adam = torch.optim.AdamW([{"params": [p for _, p in ps], "weight_decay": wd} for wd, ps in adam.items()],
                                   lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        grads = {n: torch.randn(p.shape, generator=generator) for n, p in params.items()}
        for name, param in params.items():
            param.grad = grads[name].clone()
        for name, i, param in muon:
            param.grad = (grads[name] if params[name].dim() == 2 else grads[name][i]).clone()
        for ps in adam.values():
            for name, param in ps:
                param.grad = grads[name].clone()
        ours.step()
        torch_muon.step()
        torch_adam.step()
    worst = 0.0
    for name, i, param in muon:
        mine = params[name] if params[name].dim() == 2 else params[name][i]
        worst = max(worst, (mine.detach() - param.detach()).abs().max().item())
    for ps in adam.values():
        for name, param in ps:
            worst = max(worst, (params[name].detach() - param.detach()).abs().max().item())
    assert worst <= 1e-6, worst


@pytest.mark.parametrize("parallel,named", [({"tp": 2}, "parallel.tp=2"), ({"dp": 2, "zero": 3}, "parallel.zero=3"),
                                            ({"pp": 2}, "parallel.pp=2"), ({"cp": 2}, "parallel.cp=2")])
def test_a_layout_muon_does_not_reach_is_refused(parallel, named):
    from fivefold.config import validate

    with pytest.raises(ConfigError) as err:
        validate(tiny_config({"parallel": parallel, "train": {"optimizer": "muon", "micro_batch": 1}}), world_size=2)
    assert str(err.value).startswith(f"train.optimizer = muon does not run on {named}")
    assert "use train.optimizer = adamw" in str(err.value)


def test_resuming_muon_is_refused():
    from fivefold.config import validate

    with pytest.raises(ConfigError, match=r"^train.optimizer = muon cannot resume"):
        validate(tiny_config({"train": {"optimizer": "muon"}, "checkpoint": {"resume": "auto"}}))
