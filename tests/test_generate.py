"""`fivefold generate CHECKPOINT --prompt ...`: a sample from a checkpoint the trainer wrote; greedy
is the model's argmax at every position and deterministic; bad input gets one sentence."""

from __future__ import annotations

import shutil

import pytest
import torch
from layouts import tiny_config

import fivefold
from fivefold.cli import main
from fivefold.config import ConfigError
from fivefold.tools.generate import generate
from fivefold.data.batches import ByteTokenizer

PROMPT = "def __init__(self"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from fivefold.train.trainer import train

    root = tmp_path_factory.mktemp("run")
    train(tiny_config({"train": {"steps": 3}, "checkpoint": {"dir": str(root), "every": 3}}))
    return root  # a checkpoint root: generate follows its `latest`


def test_greedy_is_the_models_argmax_and_deterministic(checkpoint):
    text, new = generate(checkpoint, PROMPT, tokens=12, temperature=0)
    assert text.startswith(PROMPT) and len(new) == 12
    assert generate(checkpoint, PROMPT, tokens=12, temperature=0) == (text, new)
    # One forward over prompt + sample: every new token is the argmax after the tokens before it.
    prompt = ByteTokenizer().encode(PROMPT).tolist()
    with torch.no_grad():
        logits = fivefold.load_pretrained(checkpoint)(torch.tensor([prompt + new]))
    assert logits[0, len(prompt) - 1:-1].argmax(-1).tolist() == new
    assert text == PROMPT + bytes(new).decode("utf-8", errors="replace")


def test_sampling_follows_its_seed(checkpoint):
    one = generate(checkpoint, PROMPT, tokens=16, temperature=1.0, seed=1)
    assert generate(checkpoint, PROMPT, tokens=16, temperature=1.0, seed=1) == one
    assert generate(checkpoint, PROMPT, tokens=16, temperature=1.0, seed=2)[1] != one[1]
    assert len(one[1]) == 16


def test_the_command_prints_the_prompt_and_its_continuation(checkpoint, capsys):
    assert main(["generate", str(checkpoint / "step_00000003"), "--prompt", PROMPT, "--tokens", "9",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out == generate(checkpoint, PROMPT, tokens=9, temperature=0)[0] + "\n"


@pytest.mark.parametrize("args, sentence", [
    (["--prompt", ""], "--prompt is empty; give the text to continue"),
    (["--prompt", "x", "--tokens", "0"], "--tokens must be at least 1 (the number of new tokens), got 0"),
    (["--prompt", "x", "--tokens", "-5"], "--tokens must be at least 1 (the number of new tokens), got -5"),
    (["--prompt", "x", "--tokens", "many"], "fivefold generate: argument --tokens: invalid int value: 'many'"),
    (["--prompt", "x", "--temperature", "-1"], "--temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
    (["--prompt", "x", "--temperature", "nan"], "--temperature must be a finite number >= 0 (0 = greedy), got nan"),
    (["--prompt", "x", "--tokenizer", "/no/such/tokenizer.json"], "--tokenizer '/no/such/tokenizer.json' is not a "
     "file; pass --tokenizer byte or --tokenizer PATH/tokenizer.json"),
    ([], "fivefold generate: the following arguments are required: --prompt"),
])
def test_bad_input_is_one_sentence(checkpoint, args, sentence, capsys):
    assert main(["generate", str(checkpoint), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {sentence}") and err.count("\n") == 1, err


def test_a_folder_that_is_not_a_checkpoint_is_refused(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path} is not a fivefold checkpoint (no state.json)\n"
    with pytest.raises(ConfigError, match="missing does not exist; give a step_N folder, a checkpoint root or a "
                                          "Hugging Face folder"):
        generate(tmp_path / "missing", "x")


def test_the_runs_tokenizer_is_used_and_a_bad_one_named(checkpoint, tmp_path, capsys):
    step = tmp_path / "step"
    shutil.copytree(checkpoint / "step_00000003", step)
    config = step / "config.toml"
    config.write_text(config.read_text().replace('tokenizer = "byte"', 'tokenizer = "gone/tokenizer.json"'))
    assert main(["generate", str(step), "--prompt", "x"]) == 2
    assert capsys.readouterr().err == ("error: the run's data.tokenizer 'gone/tokenizer.json' is not a file; pass "
                                       "--tokenizer byte or --tokenizer PATH/tokenizer.json\n")
    assert main(["generate", str(step), "--prompt", "x", "--tokens", "2", "--tokenizer", "byte"]) == 0
    (tmp_path / "tokenizer.json").write_text("not a tokenizer")
    assert main(["generate", str(step), "--prompt", "x", "--tokenizer", str(tmp_path / "tokenizer.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --tokenizer '{tmp_path / 'tokenizer.json'}' is not a Hugging Face tokenizer.json (")
    assert err.count("\n") == 1, err
