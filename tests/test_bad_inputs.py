"""The second ring of bad inputs (issue 19): each is refused with one sentence naming the key or the
file and the fix, a non-zero exit code and no traceback, through the CLI a user types.

Key values are refused before any process starts (`fivefold train --dry-run`, in this process);
files that only a rank reads (a corpus line) are refused by that rank, and the launcher prints the
sentence once however many ranks hit it. A rank that fails alone ends the whole job at once, well
inside the collective timeout.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fivefold.cli import main

# A small, fast model: data errors surface as soon as the corpus is read.
SMALL = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
         "--model.ffn_dim", "128", "--train.steps", "2", "--train.seq_len", "32", "--train.global_batch", "8",
         "--log.progress", "false"]


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as done:  # the training worker ends its process with the failure's code
        code = done.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_one_sentence(code, out, err, fragment):
    assert code not in (0, None), (code, err)
    assert "Traceback" not in out + err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


# (id, overrides, or a TOML text for a config file, and a fragment of the sentence.)
KEYS = [
    ("beta1-one", ["--train.beta1", "1.0"], "train.beta1 must be in [0, 1), got 1.0"),
    ("beta2-negative", ["--train.beta2", "-0.1"], "train.beta2 must be in [0, 1), got -0.1"),
    ("weight-decay-negative", ["--train.weight_decay", "-0.01"], "train.weight_decay must be >= 0, got -0.01"),
    ("lr-inf", ["--train.lr", "inf"], "train.lr must be a finite number, got inf"),
    ("lr-nan", ["--train.lr", "nan"], "train.lr must be a finite number, got nan"),
    ("min-lr-ratio-over-one", ["--train.min_lr_ratio", "1.5"], "train.min_lr_ratio must be in [0, 1], got 1.5"),
    ("decay-fraction-zero", ["--train.schedule", "wsd", "--train.decay_fraction", "0"],
     "train.decay_fraction must be in (0, 1], got 0.0"),
    ("warmup-negative", ["--train.warmup", "-1"], "train.warmup must be >= 0, got -1"),
    ("unknown-schedule", ["--train.schedule", "linear"], "train.schedule='linear' is not one of cosine, wsd, constant"),
    ("eval-batches-zero-with-eval", ["--train.eval_every", "10", "--train.eval_batches", "0"],
     "train.eval_batches must be > 0 when train.eval_every is set, got 0"),
    ("seed-negative", ["--train.seed", "-1"], "train.seed must be in [0, 9223372036854775808), got -1"),
    ("max-bad-steps-zero", ["--train.max_bad_steps", "0"], "train.max_bad_steps must be >= 1, got 0"),
    ("timeout-zero", ["--parallel.timeout_s", "0"], "parallel.timeout_s must be in (0, 1e+09], got 0.0"),
    ("timeout-inf-in-toml", "[parallel]\ntimeout_s = inf\n", "parallel.timeout_s must be a finite number, got inf"),
    ("timeout-nan", ["--parallel.timeout_s", "nan"], "parallel.timeout_s must be a finite number, got nan"),
    ("capacity-factor-negative", ["--model.moe.n_experts", "4", "--model.moe.capacity_factor", "-0.5"],
     "model.moe.capacity_factor must be >= 0 (0 = dropless), got -0.5"),
    ("capacity-factor-inf-in-toml", "[model.moe]\nn_experts = 4\ncapacity_factor = inf\n",
     "model.moe.capacity_factor must be a finite number, got inf"),
    ("shared-experts-negative", ["--model.moe.n_experts", "4", "--model.moe.n_shared_experts", "-1"],
     "model.moe.n_shared_experts must be >= 0, got -1"),
    ("expert-ffn-negative", ["--model.moe.n_experts", "4", "--model.moe.expert_ffn_dim", "-8"],
     "model.moe.expert_ffn_dim must be >= 0 (0 = model.ffn_dim), got -8"),
    ("aux-loss-coeff-nan", ["--model.moe.aux_loss_coeff", "nan"], "model.moe.aux_loss_coeff must be a finite number"),
    ("unknown-moe-score", ["--model.moe.n_experts", "4", "--model.moe.score", "tanh"],
     "model.moe.score='tanh' is not one of softmax, sigmoid"),
    ("rope-factors-reversed", ["--model.rope_scaling", "8", "--model.rope_low_freq_factor", "4",
                               "--model.rope_high_freq_factor", "1"],
     "model.rope_high_freq_factor=1.0 must exceed model.rope_low_freq_factor=4.0"),
    ("rope-low-factor-zero", ["--model.rope_scaling", "8", "--model.rope_low_freq_factor", "0"],
     "model.rope_low_freq_factor must be > 0, got 0.0"),
    ("yarn-betas-reversed", ["--model.preset", "tiny-deepseek-v3", "--model.rope_yarn_factor", "4",
                             "--model.rope_yarn_beta_fast", "1", "--model.rope_yarn_beta_slow", "32"],
     "model.rope_yarn_beta_fast=1.0 must exceed model.rope_yarn_beta_slow=32.0"),
    ("rope-theta-inf-in-toml", "[model]\nrope_theta = inf\n", "model.rope_theta must be a finite number, got inf"),
    ("norm-eps-zero", ["--model.norm_eps", "0"], "model.norm_eps must be > 0, got 0.0"),
    ("val-fraction-half", ["--data.val_fraction", "0.5"], "data.val_fraction must be in [0, 0.5), got 0.5"),
    ("mix-weight-inf", ["--data.mix", "a:inf,b:1"], "data.mix='a:inf,b:1' has a weight that is not a finite number"),
    ("keep-zero", ["--checkpoint.keep", "0"], "checkpoint.keep must be >= 1, got 0"),
    ("nan-steps-zero", ["--debug.nan_steps", "0"], "debug.nan_steps must be > 0, got 0"),
    ("log-every-negative", ["--log.every", "-1"], "log.every must be >= 0, got -1"),
    ("cluster-memory-negative", ["--cluster.memory_gb", "-80"], "cluster.memory_gb must be >= 0, got -80.0"),
    ("selective-under-zb", ["--model.n_layers", "4", "--parallel.pp", "2", "--parallel.pp_schedule", "zb",
                            "--parallel.pp_virtual", "2", "--train.micro_batch", "1", "--train.recompute", "selective"],
     "parallel.pp_schedule='zb' splits each backward into an input and a weight pass"),
    ("eval-under-zbv", ["--model.n_layers", "4", "--parallel.pp", "2", "--parallel.pp_schedule", "zbv",
                        "--parallel.pp_virtual", "2", "--train.micro_batch", "1", "--train.eval_every", "10"],
     "train.eval_every=10 cannot evaluate under parallel.pp_schedule='zbv'"),
    # issue 27: elastic dp, preemption, traces, snapshots, W&B
    ("dp0-not-a-multiple", ["--parallel.dp", "0", "--parallel.tp", "2", "--nproc", "3"],
     "parallel.dp=0 takes dp from the world size, but the job's 3 ranks are not a multiple of parallel.tp*pp*cp = 2*1*1 = 2"),
    ("dp0-without-world", ["--parallel.dp", "0"], "parallel.dp=0 takes dp from the world size: give --nproc N"),
    ("dp-negative", ["--parallel.dp", "-1"], "parallel.dp must be >= 0 (0 = the world size / (tp*pp*cp)), got -1"),
    ("stop-grace-zero", ["--checkpoint.stop_grace_s", "0"], "checkpoint.stop_grace_s must be > 0, got 0.0"),
    ("stop-signal-unknown", ["--debug.stop_signal", "SIGKILL"], "debug.stop_signal='SIGKILL' is not one of SIGTERM, SIGUSR1, SIGINT"),
    ("profile-steps-text", ["--log.dir", "runs/x", "--log.profile_steps", "three"],
     "log.profile_steps='three' must be step numbers and ranges from 1, e.g. '3' or '3,10-12'"),
    ("profile-steps-past-the-end", ["--log.dir", "runs/x", "--log.profile_steps", "1,5-900"],
     "log.profile_steps='1,5-900' names step 900, after the run's last (train.steps=300)"),
    ("profile-steps-without-dir", ["--log.profile_steps", "2"],
     "log.profile_steps writes its files under log.dir, which is not set; set log.dir"),
    ("memory-snapshot-on-cpu", ["--log.dir", "runs/x", "--log.memory_snapshot", "true"],
     "log.memory_snapshot records the CUDA allocator's history, and this machine has no CUDA device"),
    ("wandb-mode-unknown", ["--log.wandb_mode", "cloud"], "log.wandb_mode='cloud' is not one of online, offline"),
    # issue 28: FP8 training
    ("fp8-unknown-recipe", ["--train.dtype", "bf16", "--train.fp8", "blockwise"],
     'train.fp8=\'blockwise\' is not one of "", tensorwise, rowwise ("" = off)'),
    ("fp8-without-bf16", ["--train.fp8", "tensorwise"],
     "train.fp8='tensorwise' needs train.dtype = bf16 (FP8 matmuls inside bf16 compute"),
]


@pytest.mark.parametrize("given, fragment", [c[1:] for c in KEYS], ids=[c[0] for c in KEYS])
def test_bad_key_is_one_sentence_before_any_process(given, fragment, tmp_path, capsys):
    if isinstance(given, str):
        (tmp_path / "run.toml").write_text(given)
        given = [str(tmp_path / "run.toml")]
    _assert_one_sentence(*_cli(["train", "--dry-run", *given], capsys), fragment)


def test_fp8_without_torchao_is_one_sentence(monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` fails as where it is not installed
    code, out, err = _cli(["train", "--dry-run", "--train.dtype", "bf16", "--train.fp8", "rowwise"], capsys)
    _assert_one_sentence(code, out, err, "train.fp8='rowwise' needs torchao: pip install 'fivefold[fp8]'")


# Files: (id, a function of the test's folder giving (overrides, fragment)).
def _tokenizer_not_a_tokenizer(tmp):
    (tmp / "tokenizer.json").write_text(json.dumps({"vocab": {"a": 0}}))
    return ["--data.tokenizer", str(tmp / "tokenizer.json")], \
        f"data.tokenizer '{tmp / 'tokenizer.json'}' is not a Hugging Face tokenizer.json ("


def _tokenizer_binary(tmp):
    (tmp / "tokenizer.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    return ["--data.tokenizer", str(tmp / "tokenizer.json")], "is not a Hugging Face tokenizer.json ("


def _log_dir_is_a_file(tmp):
    (tmp / "run").write_text("")
    return ["--log.dir", str(tmp / "run")], f"log.dir='{tmp / 'run'}' is a file, not a folder; give log.dir a folder"


def _log_dir_under_a_file(tmp):
    (tmp / "run").write_text("")
    return ["--log.dir", str(tmp / "run" / "sub")], f"log.dir='{tmp / 'run' / 'sub'}' cannot be created: '{tmp / 'run'}' is a file"


def _log_dir_not_writable(tmp):
    # /proc refuses new files even to root (a chmod would not stop root, who runs CI containers).
    return ["--log.dir", "/proc/fivefold-run"], "log.dir='/proc/fivefold-run' is not writable ('/proc':"


def _checkpoint_dir_is_a_file(tmp):
    (tmp / "ckpt").write_text("")
    return ["--checkpoint.dir", str(tmp / "ckpt"), "--checkpoint.every", "2"], \
        f"checkpoint.dir='{tmp / 'ckpt'}' is a file, not a folder"


def _default_checkpoint_dir_is_a_file(tmp):
    (tmp / "checkpoints").write_text("")
    return ["--log.dir", str(tmp), "--checkpoint.every", "2"], \
        f"checkpoint.dir (empty: <log.dir>/checkpoints)='{tmp / 'checkpoints'}' is a file, not a folder"


def _document_mask_on_one_text_file(tmp):
    (tmp / "book.txt").write_text("one long text\n")
    return ["--data.source", str(tmp / "book.txt"), "--data.document_mask", "true"], \
        f"data.document_mask = true needs documents to keep attention inside, but data.source '{tmp / 'book.txt'}' holds 1 document"


FILES = [_tokenizer_not_a_tokenizer, _tokenizer_binary, _log_dir_is_a_file, _log_dir_under_a_file,
         _log_dir_not_writable, _checkpoint_dir_is_a_file, _default_checkpoint_dir_is_a_file,
         _document_mask_on_one_text_file]


@pytest.mark.parametrize("case", FILES, ids=[f.__name__.strip("_") for f in FILES])
def test_bad_file_is_one_sentence_before_any_process(case, tmp_path, capsys):
    if case is _log_dir_not_writable and not Path("/proc").is_dir():
        pytest.skip("needs /proc")
    given, fragment = case(tmp_path)
    _assert_one_sentence(*_cli(["train", "--dry-run", *given], capsys), fragment)


# A corpus only the ranks read: (id, file name, bytes, the sentence after the path).
CORPORA = [
    ("jsonl-not-json", "c.jsonl", b'{"text": "fine"}\n{"text": oops}\n', ":2 is not valid JSON"),
    ("jsonl-no-text-field", "c.jsonl", b'{"text": "fine"}\n{"body": "b"}\n', ":2 has no field 'text'; set data.text_field"),
    ("jsonl-text-not-a-string", "c.jsonl", b'{"text": ["a", "b"]}\n', ":1 field 'text' is list, not text; set data.text_field"),
    ("jsonl-text-null", "c.jsonl", b'{"text": "a"}\n{"text": null}\n', ":2 has a null 'text' field"),
    ("text-not-utf8", "c.txt", b"one\ntwo\n\xc3\x28 three\n", ":3 is not UTF-8 text (byte 8); convert the file to UTF-8"),
]


@pytest.mark.parametrize("name, data, fragment", [c[1:] for c in CORPORA], ids=[c[0] for c in CORPORA])
def test_bad_corpus_line_names_file_and_line(name, data, fragment, tmp_path, capsys):
    source = tmp_path / name
    source.write_bytes(data)
    code, out, err = _cli(["train", *SMALL, "--data.source", str(source)], capsys)
    _assert_one_sentence(code, out, err, f"{source}{fragment}")
    assert code == 2


# --- several ranks: the job ends at once, the sentence printed once ----------------------------

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TWO_RANKS = [*SMALL, "--train.steps", "6", "--data.builtin_max_bytes", "200000", "--nproc", "2",
             "--parallel.dp", "2", "--parallel.timeout_s", "120"]


def _launch(*extra, cwd=None):
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fivefold", "train", *TWO_RANKS, *extra], capture_output=True,
                          text=True, timeout=240, env=ENV, cwd=cwd)
    return done, time.monotonic() - start


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def test_one_rank_failing_ends_the_job_within_seconds(tmp_path):
    """Rank 1 raises as step 1 begins; rank 0 waits for it in a collective. The job ends far inside
    parallel.timeout_s=120 (a functional bound: without the launcher stopping the group, rank 0 would
    wait out the timeout), with rank 1's sentence once and its traceback kept in the run folder."""
    done, seconds = _launch("--debug.error_at_step", "1", "--debug.crash_rank", "1", "--log.dir", str(tmp_path))
    assert done.returncode == 1, done.stderr[-3000:]
    assert seconds < 60, seconds
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    kept = tmp_path / "error-rank1.txt"
    assert _errors(done.stderr) == [
        f"error: rank 1 failed during step 1: RuntimeError: injected by debug.error_at_step=1 (its traceback: {kept})"]
    assert "Traceback" in kept.read_text() and "maybe_crash" in kept.read_text()


def test_rank_dying_silently_is_named_once(tmp_path):
    done, seconds = _launch("--debug.crash_at_step", "1", "--debug.crash_rank", "1")
    assert done.returncode == 1 and seconds < 60, (seconds, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert _errors(done.stderr) == ["error: rank 1 exited with code 17 without saying why (it was killed or "
                                    "called os._exit); the job stopped, its output above may say more"]


def test_bad_corpus_on_every_rank_is_printed_once(tmp_path):
    source = tmp_path / "c.jsonl"
    source.write_bytes(b'{"text": "fine"}\n{"text": 7}\n')
    done, _ = _launch("--data.source", str(source))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert _errors(done.stderr) == [f"error: {source}:2 field 'text' is int, not text; set data.text_field"]
    assert not re.search(r"^[EW]\d{4} ", done.stderr, re.MULTILINE)  # torch elastic's own failure log is quiet


def test_each_kind_of_failure_is_one_sentence_and_the_launcher_names_the_cause(tmp_path):
    """What a rank hands its launcher (no processes): a bad input, out of memory, a lost peer, a
    bug; of several ranks' failures the launcher reports the first that is not an echo."""
    import torch

    from fivefold.config import ConfigError
    from fivefold.configure import load_config
    from fivefold.train import faults
    from fivefold.train.launch import first_failure

    cfg = load_config(None, ["--parallel.timeout_s", "9"])
    faults.progress.step = 3
    try:
        bad = faults.describe(ConfigError("data.source 'x' does not exist"), cfg, 1)
        oom = faults.describe(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), cfg, 1)
        lost = faults.describe(RuntimeError("[gloo/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"), cfg, 0)
        late = faults.describe(RuntimeError("Wait timeout after 9000ms"), cfg, 0)
        bug = faults.describe(KeyError("wq"), cfg, 2)
    finally:
        faults.progress.step = 0
    assert (bad.sentence, bad.exit_code, bad.echo) == ("data.source 'x' does not exist", 2, False)
    assert oom.sentence.startswith("rank 1 ran out of memory during step 3 (CUDA out of memory. Tried to allocate "
                                   "2 GiB); lower train.micro_batch") and not oom.echo
    assert lost.echo and lost.sentence == ("rank 0 lost contact with another rank during step 3; that rank failed "
                                           "first (its error says why)")
    assert late.echo and "parallel.timeout_s=9s during step 3" in late.sentence
    assert bug.sentence == "rank 2 failed during step 3: KeyError: 'wq'" and bug.traceback and not bug.echo
    for rank, (failure, at) in enumerate([(lost, 1.0), (bug, 2.0), (late, 0.5)]):  # the echoes came first
        (tmp_path / f"attempt0-rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "attempt": 0, "time": at, "sentence": failure.sentence, "echo": failure.echo}))
    assert first_failure(str(tmp_path), 0)["sentence"] == bug.sentence
    assert first_failure(str(tmp_path), 1) is None  # another attempt's records are not this one's


def test_every_number_key_declares_the_values_it_accepts():
    """One declaration per key (config_checks.checked): a new int or float key without one would
    accept any value, -1 and inf included."""
    import dataclasses
    import typing

    from fivefold.config import Config

    def keys(cls, section=""):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            dotted = f"{section}.{f.name}" if section else f.name
            if dataclasses.is_dataclass(hints[f.name]):
                yield from keys(hints[f.name], dotted)
            else:
                yield dotted, hints[f.name], f

    numbers = [(dotted, f) for dotted, typ, f in keys(Config) if typ in (int, float)]
    assert len(numbers) > 80
    assert [dotted for dotted, f in numbers if "check" not in f.metadata] == []
    for dotted, f in numbers:  # and every default passes its own declaration
        assert f.metadata["check"].problem(dotted, f.default) is None, dotted
