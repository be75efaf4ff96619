"""Resume safety: a checkpoint of another model is refused (even when its tensors happen to fit),
changed training keys follow one rule (the new value wins, with a warning), a restarted job
continues from the run's newest checkpoint, and only folders fivefold wrote are ever deleted."""

import math

import pytest
from layouts import tiny_config

from fivefold.config import ConfigError
from fivefold.checkpoint import save_load as checkpoint
from fivefold.checkpoint import resume_checks
from fivefold.train.optim import lr_multiplier
from fivefold.train.trainer import train

MOE = {"n_experts": 4, "top_k": 2, "expert_ffn_dim": 64}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    train(tiny_config({"train": {"steps": 2}, "checkpoint": {"dir": str(root), "every": 2}}))
    return root / "step_00000002"


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    train(tiny_config({"train": {"steps": 1}, "model": {"moe": MOE}, "checkpoint": {"dir": str(root), "every": 1}}))
    return root / "step_00000001"


def _refused(path, model: dict, key: str, was, now):
    cfg = tiny_config({"train": {"steps": 3}, "model": model, "checkpoint": {"resume": str(path)}})
    with pytest.raises(ConfigError) as err:
        resume_checks.check_model(path, checkpoint.read_state(path), cfg)
    assert str(err.value) == (f"checkpoint {path} is of another model (model.{key} {was!r} -> {now!r}, saved -> "
                              f"this run); resume it with its own [model] settings (its config.toml) or start "
                              f"this model without checkpoint.resume")


DENSE_KEYS = [("family", "llama", "qwen3"), ("n_layers", 2, 3), ("n_kv_heads", 2, 4), ("head_dim", 16, 32),
              ("ffn_dim", 128, 96), ("vocab_size", 256, 300), ("tie_embeddings", True, False),
              ("rope_theta", 10000.0, 500000.0), ("norm_eps", 1e-5, 1e-6), ("rope_scaling", 0.0, 8.0),
              ("rope_yarn_factor", 0.0, 4.0), ("kv_lora_rank", 0, 16)]
MOE_KEYS = [("top_k", 2, 1), ("n_experts", 4, 8), ("n_shared_experts", 0, 1), ("expert_ffn_dim", 64, 32),
            ("score", "softmax", "sigmoid"), ("norm_topk_prob", True, False), ("capacity_factor", 0.0, 1.25),
            ("routed_scaling_factor", 1.0, 2.5), ("dense_layers", "", "0")]


@pytest.mark.parametrize("key,was,now", DENSE_KEYS, ids=[k for k, _, _ in DENSE_KEYS])
def test_other_dense_model_is_refused(dense, key, was, now):
    _refused(dense, {key: now}, key, was, now)


@pytest.mark.parametrize("key,was,now", MOE_KEYS, ids=[k for k, _, _ in MOE_KEYS])
def test_other_moe_model_is_refused(moe, key, was, now):
    _refused(moe, {"moe": {**MOE, key: now}}, f"moe.{key}", was, now)


def test_two_keys_are_listed_and_a_real_resume_stops(dense):
    # rope_theta and norm_eps change no shape: before this check such a resume loaded silently.
    cfg = tiny_config({"train": {"steps": 3}, "model": {"rope_theta": 5e5, "norm_eps": 1e-6},
                       "checkpoint": {"resume": str(dense)}})
    with pytest.raises(ConfigError, match=r"is of another model \(model\.rope_theta 10000\.0 -> 500000\.0, "
                                          r"model\.norm_eps 1e-05 -> 1e-06, saved -> this run\)"):
        train(cfg)


def test_keys_that_do_not_change_the_model_are_not_compared(dense):
    cfg = tiny_config({"model": {"preset": "tiny", "max_seq_len": 512, "moe": {"aux_loss_coeff": 0.5}}})
    cfg.model.init_from = "hf-folder"  # where the weights came from, not what the model computes
    resume_checks.check_model(dense, checkpoint.read_state(dense), cfg)  # no error


def test_new_lr_wins_with_one_warning(dense, capsys):
    capsys.readouterr()
    result = train(tiny_config({"train": {"steps": 3, "lr": 1e-3, "warmup": 3},
                                "checkpoint": {"resume": str(dense)}}))
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: resuming")]
    assert warnings == [f"warning: resuming {dense} with changed training keys (train.steps 2 -> 3, train.lr 0.003 "
                        f"-> 0.001, train.warmup 2 -> 3); the new values apply from step 3"]
    t = tiny_config({"train": {"steps": 3, "lr": 1e-3, "warmup": 3}}).train
    assert [r["step"] for r in result.records] == [3]
    assert math.isclose(result.records[0]["lr"], 1e-3 * lr_multiplier(2, t), rel_tol=1e-12)


def test_restart_continues_from_the_runs_newest_checkpoint(dense, tmp_path, monkeypatch):
    """Unit level (checkpoint.resolve, which every attempt calls): the first attempt started from an
    explicit path; a restart takes the run's own newest checkpoint once the run has written one."""
    run = tmp_path / "run"
    cfg = tiny_config({"train": {"steps": 6}, "checkpoint": {"resume": str(dense), "dir": str(run), "every": 2}})
    assert checkpoint.resolve(cfg) == dense  # the first attempt
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert checkpoint.resolve(cfg) == dense  # restarted before the run saved anything: where it started
    train(tiny_config({"train": {"steps": 4}, "checkpoint": {"resume": str(dense), "dir": str(run), "every": 2}}))
    assert checkpoint.resolve(cfg) == run / "step_00000004"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert checkpoint.resolve(cfg) == dense


def test_pruning_and_cleanup_leave_foreign_folders_alone(tmp_path):
    foreign = [tmp_path / "step_00000000", tmp_path / ".tmp-notes"]
    for folder in foreign:
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
    stale = tmp_path / ".tmp-step_00000009"  # a save of fivefold's that was killed half-way
    stale.mkdir()
    (stale / checkpoint.MARKER).write_text("")
    train(tiny_config({"train": {"steps": 4}, "checkpoint": {"dir": str(tmp_path), "every": 1, "keep": 2}}))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-notes", "latest", "step_00000000",
                                                          "step_00000003", "step_00000004"]
    assert all((folder / "notes.txt").read_text() == "mine" for folder in foreign)


@pytest.mark.parametrize("name", ["step_00000001", ".tmp-step_00000001"])
def test_a_foreign_folder_at_the_step_being_saved_is_refused(tmp_path, name):
    (tmp_path / name).mkdir()
    (tmp_path / name / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=rf"{name} already exists and was not written by fivefold "
                                          r"\(no \.fivefold-checkpoint\); move it away or set another "
                                          r"checkpoint\.dir"):
        train(tiny_config({"train": {"steps": 1}, "checkpoint": {"dir": str(tmp_path), "every": 1}}))
    assert (tmp_path / name / "notes.txt").read_text() == "mine"


def test_a_checkpoint_from_before_a_key_is_compared_with_the_value_it_trained_under():
    """A checkpoint written before train.param_groups and train.optimizer existed trained with
    uniform decay and AdamW: resuming it under today's default groups is named, not silent."""
    cfg = tiny_config({})
    saved = {"train": {k: v for k, v in cfg.to_dict()["train"].items() if k not in ("param_groups", "optimizer")}}
    assert resume_checks.changed_training_keys(saved, cfg) == [
        f"train.param_groups '' -> {cfg.train.param_groups!r}"]
    same = tiny_config({"train": {"param_groups": ""}})
    assert resume_checks.changed_training_keys(saved, same) == []
