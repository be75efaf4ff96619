"""Issue 45's faults from outside: each command family (train, prepare, convert, generate, report)
run as a user runs it, a process of its own, against a real fault, not one injected at the
boundary: a file-size limit (`ulimit -f`, RLIMIT_FSIZE, with SIGXFSZ ignored as a shell's `trap ""
XFSZ` does, so a write past it fails with EFBIG as a full disk fails with ENOSPC) or a file cut
short. Each ends with exit code 2, one line on stderr and no traceback.

The train case found what the injected tests could not: torch.save's zip writer, which writes
DCP's tensor files, reports a write the storage cut short as a RuntimeError about positions, not
as the OS's error (checkpoint/save_failures.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from fivefold.models.hf.stream import make_random_hf_llama

resource = pytest.importorskip("resource")  # POSIX: the file-size limit


def _limited(kib: int):
    def preexec():
        resource.setrlimit(resource.RLIMIT_FSIZE, (kib * 1024, resource.RLIM_INFINITY))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an ignored signal stays ignored across exec
    return preexec


def _one_line(cwd, *argv, limit_kib: int | None = None) -> str:
    done = subprocess.run([sys.executable, "-m", "fivefold", *map(str, argv)], cwd=cwd, capture_output=True,
                          text=True, timeout=300, preexec_fn=_limited(limit_kib) if limit_kib else None)
    assert done.returncode == 2 and "Traceback" not in done.stderr, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0].removeprefix("error: ")


LIMIT = "the file passed the file-size limit; raise the limit (ulimit -f)"


def test_train_checkpoint_past_the_file_size_limit(tmp_path):
    run = tmp_path / "run"
    said = _one_line(tmp_path, "train", "single", "--train.steps", "1", "--log.dir", run, "--checkpoint.every", "1",
                     "--log.progress", "false", limit_kib=200)
    assert said == (f"cannot write checkpoint {run / 'checkpoints' / 'step_00000001'}: {LIMIT} or set checkpoint.dir "
                    "to another folder; no earlier checkpoint was touched")
    assert [p.name for p in (run / "checkpoints").iterdir()] == []  # no half-written folder for resume = auto


def test_prepare_past_the_file_size_limit(tmp_path):
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 5000)  # 220 kB
    said = _one_line(tmp_path, "prepare", "corpus.txt", "--out", "data", "--workers", "1", limit_kib=100)
    assert said == (f"cannot write data: {LIMIT} or choose another --out; finished shards are kept and the same "
                    "command continues where it stopped")


def test_convert_past_the_file_size_limit(tmp_path):
    make_random_hf_llama(tmp_path / "hf", hidden=64, layers=2, heads=2, kv_heads=2, ffn=128, vocab=256)
    said = _one_line(tmp_path, "convert", tmp_path / "hf", tmp_path / "ckpt", limit_kib=50)
    assert said == f"cannot write {tmp_path / 'ckpt'}: {LIMIT} or choose another DST"
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size > 50 * 1024  # the source is untouched


def test_generate_with_a_tokenizer_cut_short(tmp_path):
    make_random_hf_llama(tmp_path / "hf", hidden=32, layers=1, heads=2, kv_heads=2, ffn=64, vocab=256)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {"a"')
    said = _one_line(tmp_path, "generate", tmp_path / "hf", "--prompt", "hi", "--tokenizer", tokenizer)
    assert said == (f"--tokenizer '{tokenizer}' is not a Hugging Face tokenizer.json (EOF while parsing an object at "
                    "line 1 column 57); give the tokenizer.json of a model (its folder holds one) or 'byte'")


def test_report_past_the_file_size_limit(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 / s, "grad_norm": 1.0, "lr": 1e-3,
                                                           "tokens_per_sec": 1e3, "step_time_s": 0.1}) + "\n"
                                               for s in range(1, 30)))
    said = _one_line(tmp_path, "report", run, limit_kib=4)
    assert said == f"cannot write {run / 'report'}: {LIMIT} or free space and run fivefold report again"
