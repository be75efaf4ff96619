"""Parameter groups (train.param_groups, config/param_groups.py): kinds and regex select tensors,
each group's weight decay and lr scale reach the optimizer in every layout. ZeRO-1/2 buckets never
mix two settings, so a chunk cutting through tensors updates each with its own group's settings.

One 2-rank spawn runs every layout (zero 0/1/2/3, tp2) and a resume whose groups changed; each is
compared with the single process under the harness rule (tests/layouts.py)."""

import pytest

from layouts import TP_WEIGHT_ATOL, assert_same_run, reference, run_layout, tiny_config
from ranks import run_on_ranks

from fivefold.config import ConfigError

# The layouts train the tiny llama (norms, a tied embedding; gpt-oss's biases, sinks and router
# are checked in the single process below) with weight decay large enough that a norm or the
# embedding decayed by mistake moves by ~1e-3 per step (the bounds are ~1e-5).
GROUPS = "norm|bias|embedding: weight_decay=0; re:layers\\.1\\.: lr_scale=0.5; mlp: lr_scale=2"
TRAIN = {"weight_decay": 0.5, "param_groups": GROUPS, "micro_batch": 2, "steps": 4}
CHANGED = "norm|bias: weight_decay=0; attention: weight_decay=0.05, lr_scale=3"
GPT_OSS = {"preset": "tiny-gpt-oss", "n_layers": 2}


def _layout(**parallel) -> dict:
    return {"parallel": parallel, "train": TRAIN}


# zero 0 updates whole tensors as the single process does; zero 1/2's chunks are what groups cut.
LAYOUTS = {"dp2 zero1": _layout(dp=2, zero=1), "dp2 zero2": _layout(dp=2, zero=2),
           "dp2 zero3": _layout(dp=2, zero=3), "tp2": _layout(tp=2)}


def _resumed(root: str, parallel: dict) -> dict:
    """Save at step 3 with GROUPS, then resume with CHANGED groups (the new values win)."""
    return {"parallel": parallel, "train": {**TRAIN, "param_groups": CHANGED},
            "checkpoint": {"resume": f"{root}/step_00000002"}}


def _saving(root: str, parallel: dict) -> dict:
    return {"parallel": parallel, "train": TRAIN, "checkpoint": {"dir": root, "every": 2}}


def two_ranks(root: str) -> dict:
    out = {label: run_layout(layout) for label, layout in LAYOUTS.items()}
    run_layout(_saving(root, {"dp": 2, "zero": 1}))
    out["resumed dp2 zero2"] = run_layout(_resumed(root, {"dp": 2, "zero": 2}))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_on_ranks(2, two_ranks, str(tmp_path_factory.mktemp("groups")))


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_layout_matches_the_single_process(runs, label):
    want = reference(LAYOUTS[label])
    atol = TP_WEIGHT_ATOL if "tp" in label else 1e-5
    for rank, results in enumerate(runs):
        assert_same_run(results[label], want, weight_atol=atol, label=f"{label} rank {rank}")


def test_resume_with_changed_groups_matches_the_single_process(runs, tmp_path, capsys):
    root = str(tmp_path)
    run_layout(_saving(root, {}))
    capsys.readouterr()
    want = run_layout(_resumed(root, {}))
    warning = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: resuming")]
    assert len(warning) == 1 and f"train.param_groups {GROUPS!r} -> {CHANGED!r}" in warning[0], warning
    want.weight_noise = reference(LAYOUTS["dp2 zero2"]).weight_noise
    for rank, results in enumerate(runs):
        assert_same_run(results["resumed dp2 zero2"], want, label=f"resumed rank {rank}")


def test_groups_reach_the_optimizer():
    """The single process's optimizer: norms, biases and embeddings undecayed by default, the rest
    at train.weight_decay; lr scales by regex and kind, later groups refining earlier ones."""
    from fivefold.train.optim import build_optimizer
    from fivefold.train.trainer import setup

    cfg = tiny_config({"model": GPT_OSS, "train": {**TRAIN, "param_groups": GROUPS.replace("mlp", "router")}})
    _, par = setup(cfg)
    optimizer = par.optimizer(lambda params: build_optimizer(params, par.settings_of, cfg.train))
    names = {id(p): n for n, p in par.parts[0].named_parameters()}
    seen = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            seen[names[id(param)]] = (group["weight_decay"], group["lr"] / cfg.train.lr)
    kinds = {"tok_embeddings.weight": 0.0, "layers.0.attention_norm.weight": 0.0, "norm.weight": 0.0,
             "layers.0.attention.wq.bias": 0.0, "layers.0.feed_forward.experts.b1": 0.0,
             "layers.0.attention.wq.weight": 0.5, "layers.0.feed_forward.experts.w1": 0.5,
             "layers.0.attention.sinks.weight": 0.5}
    for name, decay in kinds.items():
        assert name in seen, sorted(seen)
        assert seen[name][0] == decay, (name, seen[name])
    assert seen["layers.0.attention.wq.weight"][1] == 1.0
    assert seen["layers.1.attention.wq.weight"][1] == 0.5
    assert seen["layers.1.feed_forward.experts.w1"][1] == 0.5
    assert seen["layers.0.feed_forward.router.gate.weight"][1] == 2.0
    assert seen["layers.1.feed_forward.router.gate.weight"][1] == 2.0  # the router group comes later: it wins


@pytest.mark.parametrize("text,problem", [
    ("norms: weight_decay=0", "'norms' is not a parameter kind"),
    ("weight_decay=0", "has no 'SELECTOR:' before its settings"),
    ("norm: decay=0", "'decay=0' is not one of lr_scale=..., weight_decay=..., optimizer=..."),
    ("norm: lr_scale=0", "lr_scale=0 must be a number > 0"),
    ("re:[: lr_scale=2", "'[' is not a regular expression"),
    ("norm: optimizer=muon", "Muon updates matrices only"),
])
def test_a_bad_group_is_one_sentence(text, problem):
    from fivefold.configure import validate

    with pytest.raises(ConfigError) as err:
        validate(tiny_config({"train": {"param_groups": text}}))
    assert str(err.value).startswith(f"train.param_groups='{text}': ") and problem in str(err.value)
    assert "\n" not in str(err.value)
