"""Two-matrix feed-forwards (model.mlp_activation = gelu | relu2, issue 41: GPT-3's and
Nemotron-4's MLPs): the block computes w2(act(w1 x)) with no w3, the planner counts what the model
holds, and every dimension that splits or shards the MLP equals the single-process run of the same
model: dp2 at zero 1 and 3, tp2 with and without sequence parallelism (w1 split by hidden units, w2
by its input), pp2 (1f1b and zbv) and cp2, all in one group of 2 ranks. Export to Hugging Face,
whose Llama is SwiGLU only, is refused in one sentence."""

import pytest
import torch
import torch.nn.functional as F

from fivefold.config import ConfigError
from fivefold.configure import load_config, validate
from fivefold.models import build_model
from fivefold.plan.model_stats import model_stats
from layouts import ONE_DIMENSION, assert_same_run, reference, run_layout, weight_atol
from ranks import run_on_ranks

TRAIN = {"micro_batch": 1}
LAYOUTS = {name: ONE_DIMENSION[name] for name in ("dp2 z1", "dp2 z3", "tp2 sp", "tp2 no-sp", "pp2 1f1b", "pp2 zbv",
                                                  "cp2 ring")}
ACTIVATIONS = ("gelu", "relu2")
CASES = [(act, name) for act in ACTIVATIONS for name in LAYOUTS]


def _settings(act: str, parallel: dict | None = None) -> dict:
    out = {"model": {"mlp_activation": act, "n_layers": 4}, "train": TRAIN}  # 4 layers: zbv's 4 stages
    return {**out, "parallel": parallel} if parallel is not None else out


@pytest.mark.parametrize("act, function", [("gelu", F.gelu), ("relu2", lambda u: F.relu(u) ** 2)])
def test_the_block_is_two_matrices_around_the_activation(act, function):
    cfg = load_config(None, ["--model.mlp_activation", act])
    model = build_model(cfg.model, 0)
    ffn = model.layers["0"].feed_forward
    assert not hasattr(ffn, "w3")
    x = torch.randn(3, 5, cfg.model.dim)
    torch.testing.assert_close(ffn(x), ffn.w2(function(ffn.w1(x))))
    # The planner's statistics hold what the model holds: 2 h f per MLP, not SwiGLU's 3 h f.
    stats = model_stats(cfg.model)
    assert stats.mlp_matrices == 2
    assert sum(p.numel() for p in model.parameters()) == stats.total_params


def test_export_to_hugging_face_is_refused_in_one_sentence(tmp_path):
    cfg = load_config(None, ["--model.mlp_activation", "relu2", "--checkpoint.export_hf", str(tmp_path / "hf"),
                             "--checkpoint.dir", str(tmp_path / "ck")])
    with pytest.raises(ConfigError, match="needs model.mlp_activation='swiglu'"):
        validate(cfg)
    with pytest.raises(ConfigError, match="implemented by model.family llama only"):
        validate(load_config(None, ["--model.mlp_activation", "gelu", "--model.preset", "tiny-qwen3"]))


def on_two_ranks() -> dict:
    return {(act, name): run_layout(_settings(act, LAYOUTS[name])) for act, name in CASES}


@pytest.fixture(scope="module")
def two_rank_results():
    return run_on_ranks(2, on_two_ranks)


@pytest.mark.parametrize("act, name", CASES, ids=[f"{a} {n}" for a, n in CASES])
def test_layout_equals_one_process(two_rank_results, act, name):
    want = reference(_settings(act))
    for rank, results in enumerate(two_rank_results):
        assert_same_run(results[(act, name)], want, weight_atol=weight_atol(LAYOUTS[name]),
                        label=f"{act} {name} rank {rank}")


def test_the_activations_make_other_models(two_rank_results):
    """Not SwiGLU under another name: the same seed and data give other losses."""
    swiglu = reference({"model": {"n_layers": 4}, "train": TRAIN}).losses
    for act in ACTIVATIONS:
        assert abs(reference(_settings(act)).losses[-1] - swiglu[-1]) > 1e-3, act
