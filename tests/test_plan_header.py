"""The plan says what it assumed (issue 51): its header names the precision, sequence, global batch,
LoRA, and the GPU with its memory in GiB and GB; a model planned at the trainer's tiny-model defaults
is said to be. The real command, as its own process."""

import subprocess
import sys


def _plan(*args) -> str:
    done = subprocess.run([sys.executable, "-m", "fivefold", "plan", *args], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_shipped_config_is_planned_as_it_runs():
    head = _plan("llama3-8b").splitlines()
    assert head[0] == ("llama3-8b on 8 x h100 (79.6 GiB = 85.5 GB), bf16, seq 8192, global batch 1024, no LoRA: "
                       "best layouts by predicted tokens/s per GPU")
    assert not head[1].startswith("note:")


def test_a_preset_at_the_demo_defaults_says_so():
    head = _plan("--model.preset", "llama3-8b", "--cluster.gpus", "8").splitlines()
    assert "fp32, seq 128, global batch 16, no LoRA" in head[0]
    assert head[1] == ("note: planned at the trainer's demo defaults (fp32, seq 128, global batch 16); a real run of "
                       "this model sets --train.dtype bf16, --train.seq_len (up to its 131072) and --train.global_batch")


def test_lora_is_named():
    head = _plan("llama3-8b", "--lora.rank", "16").splitlines()
    assert "no LoRA" not in head[0] and "LoRA rank 16 on attention|mlp" in head[0]
