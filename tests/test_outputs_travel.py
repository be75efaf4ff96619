"""A LoRA run's outputs work from anywhere (issue 51): the checkpoint records its base folder
absolute, so `generate` and `convert` read it from any working directory; when the base has moved,
`--base FOLDER` says where it is now, and the weights there are still checked against what the run
recorded. Each step is the real command, as its own process, from its own working directory."""

import json
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)


def _fivefold(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fivefold", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def _save_llama(folder, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(folder)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run started in `work/` with model.init_from given relative to it ("base")."""
    work = tmp_path_factory.mktemp("travel") / "work"
    work.mkdir()
    _save_llama(work / "base", seed=0)
    done = _fivefold("train", "--model.init_from", "base", "--lora.rank", "4", "--train.steps", "2",
                     "--train.seq_len", "32", "--train.global_batch", "2", "--checkpoint.dir", "ckpt",
                     "--checkpoint.every", "2", "--log.dir", "run", cwd=work)
    assert done.returncode == 0, done.stderr[-2000:]
    return work


def test_the_checkpoint_records_its_base_absolute(lora_run):
    state = json.loads((lora_run / "ckpt" / "step_00000002" / "state.json").read_text())
    assert state["lora_base"]["init_from"] == str((lora_run / "base").resolve())


def test_generate_and_convert_work_from_another_directory(lora_run, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = _fivefold("generate", lora_run / "ckpt", "--prompt", "def ", "--tokens", "3", "--temperature", "0",
                     cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("def ")
    done = _fivefold("convert", lora_run / "ckpt", "peft", cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    config = json.loads((elsewhere / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((lora_run / "base").resolve())


def test_a_moved_base_is_found_with_base(lora_run, tmp_path):
    moved = tmp_path / "moved-base"
    shutil.copytree(lora_run / "base", moved)
    (lora_run / "base").rename(lora_run / "base-away")
    try:
        lost = _fivefold("generate", lora_run / "ckpt", "--prompt", "x", "--tokens", "2", cwd=tmp_path)
        assert lost.returncode == 2 and "give its new place with --base FOLDER" in lost.stderr.strip().splitlines()[-1]
        found = _fivefold("generate", lora_run / "ckpt", "--prompt", "x", "--tokens", "2", "--temperature", "0",
                          "--base", moved, cwd=tmp_path)
        assert found.returncode == 0, found.stderr
        merged = _fivefold("convert", "--merge", "--base", moved, lora_run / "ckpt", tmp_path / "merged", cwd=tmp_path)
        assert merged.returncode == 0, merged.stderr
        assert (tmp_path / "merged" / "config.json").is_file()
        peft = _fivefold("convert", "--base", moved, lora_run / "ckpt", tmp_path / "peft", cwd=tmp_path)
        assert peft.returncode == 0, peft.stderr
        config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(moved.resolve())
        # The PEFT folder's base moved too: --base for it as well.
        from_peft = _fivefold("generate", tmp_path / "peft", "--prompt", "x", "--tokens", "2", "--temperature", "0",
                              "--base", moved, cwd=tmp_path)
        assert from_peft.returncode == 0, from_peft.stderr
    finally:
        (lora_run / "base-away").rename(lora_run / "base")


def test_base_naming_other_weights_is_refused(lora_run, tmp_path):
    other = tmp_path / "other"
    _save_llama(other, seed=1)
    done = _fivefold("generate", lora_run / "ckpt", "--prompt", "x", "--tokens", "2", "--base", other, cwd=tmp_path)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert "now holds other weights" in last and "Traceback" not in done.stderr


def test_base_for_a_whole_model_is_refused(tmp_path):
    _save_llama(tmp_path / "hf", seed=0)
    done = _fivefold("generate", tmp_path / "hf", "--prompt", "x", "--tokens", "2", "--base", tmp_path / "hf",
                     cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: --base names the base of LoRA adapters, and {tmp_path / 'hf'} is a whole Hugging Face model; "
        "drop --base")
