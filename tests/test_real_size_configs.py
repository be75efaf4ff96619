"""A shipped real-size config does not run on the demo's defaults (issue 51): its data.source is
left for the user, so `fivefold train` (and --dry-run, which says what the launch would) refuses in
one sentence naming data.source and data.tokenizer, while `plan` and `layout` need no data; metrics
and checkpoints are on, in a run folder named after the config. The real commands, as processes."""

import subprocess
import sys

import pytest

from fivefold.config import shipped
from fivefold.configure import load_config
from fivefold.plan.model_stats import model_stats

REFUSAL = ("error: data.source is not set, and this config's model is not one to train on the built-in demo "
           "bytes; set data.source to your corpus (a folder from `fivefold prepare`, or text/jsonl/parquet files) "
           "and data.tokenizer to the model's tokenizer.json, or data.source = builtin to run on the demo bytes anyway")
# (finetune starts from a folder the chat demo makes: a small model, not one of these)
REAL = [name for name in shipped.names()
        if name != "finetune" and model_stats(load_config(name).model).total_params > 1e9]


def _fivefold(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fivefold", *args], capture_output=True, text=True, timeout=300)


def test_the_real_size_configs_are_the_large_ones():
    assert {"llama3-8b", "llama3-405b", "gpt-oss-120b", "deepseek-v3"} <= set(REAL)
    assert "tiny" not in REAL and "demo" not in REAL


@pytest.mark.parametrize("name", REAL)
def test_data_is_the_users_and_the_run_keeps_its_outputs(name):
    cfg = load_config(name)
    assert cfg.data.source == "" and cfg.log.dir == f"runs/{name}" and cfg.checkpoint.every > 0


def test_train_and_dry_run_refuse_the_demo_bytes_in_one_sentence():
    for args in (["--dry-run"], ["--nproc", "8"]):
        done = _fivefold("train", "llama3-8b", *args)
        assert done.returncode == 2 and done.stderr.strip() == REFUSAL, done.stderr


def test_plan_and_layout_need_no_data():
    assert _fivefold("layout", "llama3-8b").returncode == 0
    assert _fivefold("plan", "llama3-8b", "--json").returncode == 0


def test_the_demo_bytes_when_asked_for():
    done = _fivefold("train", "llama3-8b", "--data.source", "builtin", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "rank   0" in done.stdout
