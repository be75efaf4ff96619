"""A Hugging Face model is fed its own tokenizer's ids (issue 51): with model.init_from and
data.tokenizer unset, the folder's tokenizer.json is the run's tokenizer; a folder without one
whose vocabulary is more than bytes is refused for raw text instead of falling back to bytes; data
prepared with another tokenizer is refused naming the folder and the command that fixes it. Each
case runs the real command as its own process."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from chat_data import make_tokenizer  # noqa: E402

SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False)


def _fivefold(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fivefold", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(a model folder with its tokenizer.json, the same model without one, a text file)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("model_tokenizer")
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    with_tokenizer, without = root / "with", root / "without"
    model.save_pretrained(with_tokenizer)
    model.save_pretrained(without)
    make_tokenizer(with_tokenizer)
    text = root / "notes.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    return with_tokenizer, without, text


def test_the_model_folders_tokenizer_is_the_default(folders):
    with_tokenizer, _, text = folders
    shown = _fivefold("config", "show", "--model.init_from", str(with_tokenizer), "--data.source", str(text))
    assert shown.returncode == 0, shown.stderr
    assert f'tokenizer = "{with_tokenizer / "tokenizer.json"}"' in shown.stdout
    # Explicit is explicit: bytes when asked for.
    shown = _fivefold("config", "show", "--model.init_from", str(with_tokenizer), "--data.source", str(text),
                      "--data.tokenizer", "byte")
    assert 'tokenizer = "byte"' in shown.stdout


def test_a_run_trains_on_the_models_ids(folders, tmp_path):
    """One step of the real trainer: the data it read was tokenized with the folder's BPE (the
    console says the tokenizer), not bytes."""
    with_tokenizer, _, text = folders
    done = _fivefold("train", "--model.init_from", str(with_tokenizer), "--data.source", str(text),
                     "--train.steps", "1", "--train.seq_len", "32", "--train.global_batch", "2",
                     "--log.dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"data: {text}, tokenized by {with_tokenizer / 'tokenizer.json'}" in done.stdout.splitlines()


def test_a_folder_without_a_tokenizer_is_refused_for_text(folders):
    _, without, text = folders
    done = _fivefold("train", "--model.init_from", str(without), "--data.source", str(text), "--train.steps", "1")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: model.init_from='{without}' has no tokenizer.json and a vocabulary of 512, so the text in "
        "data.source would be tokenized as bytes; set data.tokenizer to the model's tokenizer.json (or to "
        "'byte' to train it on bytes anyway)")
    assert "Traceback" not in done.stderr


def test_data_prepared_with_another_tokenizer_is_refused(folders, tmp_path):
    with_tokenizer, _, text = folders
    prepared = tmp_path / "bytes"
    done = _fivefold("prepare", str(text), "--tokenizer", "byte", "--out", str(prepared))
    assert done.returncode == 0, done.stderr
    assert json.loads((prepared / "manifest.json").read_text())["tokenizer"]["name"] == "byte"
    done = _fivefold("train", "--model.init_from", str(with_tokenizer), "--data.source", str(prepared),
                     "--train.steps", "1")
    assert done.returncode == 2
    own = with_tokenizer / "tokenizer.json"
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: data.source folder '{prepared}' was prepared with the byte tokenizer, not model.init_from's "
        f"{own}; prepare it again with `fivefold prepare SRC --tokenizer {own}`")
