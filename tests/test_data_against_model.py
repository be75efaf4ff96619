"""Data checked against the model before the first step (issue 52): `prepare` records the largest
token id and a run refuses one the model has no embedding row for, naming model.vocab_size; shards
changed after `prepare` are refused at the batch that reads them, not by an IndexError inside the
model; `prepare` of an empty file is one sentence; a resume that changes train.seq_len is refused
naming train.seq_len; `generate` says when a prompt is longer than the model reads."""

from __future__ import annotations

import json

import numpy as np
import pytest
from outside_the_run import Untouched, fivefold, refused, succeeded, train


@pytest.fixture
def prepared(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("hello world, the quick brown fox. " * 300)
    succeeded(fivefold("prepare", text, "--out", tmp_path / "data"))
    return tmp_path / "data"


def test_prepare_records_the_largest_token_id_and_a_run_refuses_one_the_model_cannot_embed(prepared, tmp_path):
    manifest = json.loads((prepared / "manifest.json").read_text())
    tokens = np.fromfile(prepared / manifest["shards"][0]["file"], dtype=manifest["dtype"])
    assert manifest["max_token_id"] == int(tokens.max()) == ord("x")
    # A tokenizer of 300 ids whose data uses id 280, for a model of 256: refused before any process starts.
    manifest["tokenizer"]["vocab_size"], manifest["max_token_id"] = 256, 280
    (prepared / "manifest.json").write_text(json.dumps(manifest))
    said = refused(train("--train.steps", "1", "--data.source", prepared, "--log.dir", tmp_path / "run"))
    assert said == (f"data.source folder '{prepared}' holds token id 280, but model.vocab_size=256 gives ids 0..255; "
                    "raise model.vocab_size to at least 281, or prepare the data with the model's tokenizer")
    assert not (tmp_path / "run").exists()


def test_a_shard_changed_after_prepare_is_refused_before_the_model_reads_it(prepared, tmp_path):
    manifest = json.loads((prepared / "manifest.json").read_text())
    del manifest["max_token_id"]  # as a folder prepared before the id was recorded
    (prepared / "manifest.json").write_text(json.dumps(manifest))
    shard = prepared / manifest["shards"][0]["file"]
    tokens = np.fromfile(shard, dtype=manifest["dtype"])
    tokens[::7] = 1000  # ids the byte tokenizer never makes, and the 256-row embedding has no row for
    tokens.tofile(shard)
    said = refused(train("--train.steps", "1", "--data.source", prepared, "--log.dir", tmp_path / "run"))
    assert said == (f"{prepared} holds token id 1000, but its tokenizer has 256 tokens ({prepared / 'manifest.json'}): "
                    "the shards were altered after they were prepared; prepare the folder again (`fivefold prepare "
                    f"SRC... --out {prepared}`) or restore it from a copy")


def test_prepare_of_an_empty_file_is_one_sentence(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    watch = Untouched(tmp_path)
    said = refused(fivefold("prepare", tmp_path / "empty.txt", "--out", tmp_path / "data"))
    assert said == (f"{tmp_path / 'empty.txt'} is empty (0 bytes of text), so there is nothing to prepare; give "
                    "fivefold prepare files that hold text")
    watch.check()  # no folder made, nothing written


def test_a_changed_seq_len_on_resume_names_the_key(tmp_path):
    run = tmp_path / "run"
    succeeded(train("--train.steps", "2", "--checkpoint.every", "1", "--log.dir", run))
    watch = Untouched(run / "checkpoints", but=(".fivefold-lock",))
    said = refused(train("--train.steps", "3", "--train.seq_len", "16", "--log.dir", run, "--checkpoint.resume", "auto",
                         "--checkpoint.verify", "sizes"))
    assert said == (f"checkpoint {run / 'checkpoints' / 'step_00000002'} trained with train.seq_len = 32 and this run "
                    "has train.seq_len = 16: its data position (step 2) counts batches under the old value and cannot "
                    "continue under the new one; resume with train.seq_len = 32, or start a new run in another log.dir")
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_generate_says_when_a_prompt_is_longer_than_the_model_reads(tmp_path):
    run = tmp_path / "run"
    succeeded(train("--train.steps", "1", "--checkpoint.every", "1", "--log.dir", run))
    done = succeeded(fivefold("generate", run / "checkpoints", "--prompt", "a" * 50, "--tokens", "2"))
    assert ("note: the prompt is 50 tokens but the model reads at most 32 (model.max_seq_len); it continues from the "
            "prompt's last 32 tokens, and its first 18 are not read") in done.stderr.splitlines()
    done = succeeded(fivefold("generate", run / "checkpoints", "--prompt", "a" * 30, "--tokens", "5"))
    assert ("note: the prompt (30 tokens) and --tokens 5 pass the model's 32-token window (model.max_seq_len); past "
            "it, each new token is predicted from the last 32 tokens only") in done.stderr.splitlines()
    done = succeeded(fivefold("generate", run / "checkpoints", "--prompt", "a" * 10, "--tokens", "5"))
    assert "note:" not in done.stderr
