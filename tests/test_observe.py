"""Looking at a run (issue 27): torch.profiler traces of the chosen steps, Weights & Biases in
offline mode beside metrics.jsonl, and `fivefold report` drawing the run as pictures."""

import glob
import json

import pytest

from layouts import tiny_config

from fivefold.cli import main

MOE = {"moe": {"n_experts": 4, "top_k": 2, "expert_ffn_dim": 64}}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A one-process MoE run of 4 steps: step 3 traced, every step to W&B (offline), eval every 2."""
    pytest.importorskip("wandb")
    from fivefold.train.trainer import train

    path = tmp_path_factory.mktemp("observed")
    train(tiny_config({"model": MOE, "train": {"steps": 4, "eval_every": 2},
                       "log": {"dir": str(path), "every": 2, "profile_steps": "3", "wandb": True,
                               "wandb_mode": "offline"}}))
    return path


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_only_the_chosen_steps_are_traced(run_dir):
    traces = sorted(p.name for p in (run_dir / "traces").iterdir())
    assert traces == ["rank0-step3.json"]
    events = json.loads((run_dir / "traces" / traces[0]).read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)  # the step's matmuls, as Perfetto shows them


def test_wandb_offline_holds_every_logged_number(run_dir):
    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "*.wandb"))
    written = open(path, "rb").read()  # protobuf records: the logged values appear as JSON text
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert json.dumps(r["loss"]).encode() in written, r["step"]
        if "val_loss" in r:
            assert json.dumps(r["val_loss"]).encode() in written, r["step"]
    assert b"moe/layer0/tokens/expert3" in written  # the per-expert charts, as TensorBoard gets them


def test_report_draws_the_panels_the_run_recorded(run_dir, capsys):
    import matplotlib.image

    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote 4 pictures to {run_dir}/report: loss.png (loss and held-out loss); "
                          "speed.png (tokens per second (all ranks), MFU); memory.png (peak memory per rank); "
                          "moe_load.png (MoE load: share of each layer's tokens per expert)"), out
    for name in ("loss.png", "speed.png", "memory.png", "moe_load.png"):
        image = matplotlib.image.imread(run_dir / "report" / name)
        assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0, name  # drawn, not blank
    assert not (run_dir / "report" / "pipeline.png").exists()  # no pipeline in this run


def test_report_of_a_folder_without_metrics_is_one_sentence(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path} has no metrics.jsonl; give the log.dir of a run"
