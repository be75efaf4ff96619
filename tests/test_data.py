"""Data: corpus, tokenizers, packing into windows, and the layout-independent, resumable sampler."""

from __future__ import annotations

import hashlib
import json
import os
import string
import subprocess
import sys

import pytest
import torch

from fivefold.config import ConfigError, DataConfig
from fivefold.train.data import (ByteTokenizer, GlobalBatchSampler, HFTokenizer, Split, documents,
                                 load_splits, rank_slice)

SAMPLE = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n"
          "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.\n") * 8


# ---------------------------------------------------------------- corpus


def test_builtin_corpus_is_real_text_and_deterministic():
    cfg = DataConfig(builtin_max_bytes=60_000)
    docs = list(documents(cfg))
    assert docs == list(documents(cfg))
    text = "".join(docs)
    assert len(text) >= 60_000
    assert len(docs) >= 2
    printable = sum(ch in string.printable for ch in text) / len(text)
    assert printable > 0.97, f"only {printable:.2%} printable"
    letters = sum(ch.isalpha() for ch in text) / len(text)
    assert letters > 0.4, f"only {letters:.2%} letters"
    for word in ("def ", "return", "import ", " the "):
        assert word in text
    # A larger budget extends the same document sequence (stable order).
    more = list(documents(DataConfig(builtin_max_bytes=120_000)))
    assert more[: len(docs)] == docs and len(more) > len(docs)


def test_builtin_corpus_is_the_same_in_another_process():
    """Another process (with another string-hash seed) reads exactly the same corpus."""
    code = ("import hashlib; from fivefold.config import DataConfig; from fivefold.train.data import documents; "
            "print(hashlib.sha256('\\0'.join(documents(DataConfig(builtin_max_bytes=60_000))).encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONHASHSEED="12345"),
                         capture_output=True, text=True, check=True).stdout.strip()
    here = hashlib.sha256("\0".join(documents(DataConfig(builtin_max_bytes=60_000))).encode()).hexdigest()
    assert out == here


def test_builtin_splits_are_deterministic():
    cfg = DataConfig(builtin_max_bytes=30_000, val_fraction=0.1)
    train_a, val_a = load_splits(cfg, seq_len=32, vocab_size=256)
    train_b, val_b = load_splits(cfg, seq_len=32, vocab_size=256)
    assert torch.equal(train_a.tokens, train_b.tokens) and torch.equal(val_a.tokens, val_b.tokens)
    total = len(train_a.tokens) + len(val_a.tokens)
    assert len(val_a.tokens) == int(total * 0.1)
    assert train_a.tokens.dtype == torch.int64
    assert int(train_a.tokens.min()) >= 0 and int(train_a.tokens.max()) < 256
    # The held-out split is the tail of the same stream.
    whole = torch.cat([train_a.tokens, val_a.tokens])
    expected = "".join(doc + "\n" for doc in documents(cfg)).encode("utf-8")
    assert whole.tolist() == list(expected)


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo wörld ✓ — 数据\n\ttabs"
    ids = tok.encode(text)
    assert ids.tolist() == list(text.encode("utf-8"))
    assert len(ids) == len(text.encode("utf-8")) > len(text)
    assert tok.decode(ids) == text
    assert tok.vocab_size == 256


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A small byte-level BPE tokenizer.json trained here (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([SAMPLE] * 4, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path), tok.get_vocab_size()


def test_hf_tokenizer_round_trip(hf_tokenizer):
    path, vocab = hf_tokenizer
    tok = HFTokenizer(path)
    assert tok.vocab_size == vocab > 256
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE
    assert len(ids) < len(SAMPLE.encode()) / 2  # merges learned: far fewer tokens than bytes
    assert int(ids.max()) < vocab


def test_hf_tokenizer_through_data_config(tmp_path, hf_tokenizer):
    path, vocab = hf_tokenizer
    source = tmp_path / "corpus.txt"
    source.write_text(SAMPLE)
    cfg = DataConfig(source=str(source), tokenizer=path, val_fraction=0.0)
    train, val = load_splits(cfg, seq_len=8, vocab_size=vocab)
    expected = HFTokenizer(path).encode(SAMPLE + "\n").tolist()
    assert train.tokens.tolist() == expected
    assert len(val.tokens) == 0
    assert int(train.tokens.max()) >= 256  # merged tokens are really used
    with pytest.raises(ConfigError) as info:
        load_splits(cfg, seq_len=8, vocab_size=256)
    assert str(info.value) == (f"the tokenizer has {vocab} tokens but model.vocab_size=256; raise "
                               f"model.vocab_size to at least {vocab}")


# ---------------------------------------------------------------- local files


def test_local_txt(tmp_path):
    source = tmp_path / "notes.txt"
    source.write_text("alpha beta gamma\ndelta")
    cfg = DataConfig(source=str(source), val_fraction=0.0)
    assert list(documents(cfg)) == ["alpha beta gamma\ndelta"]
    train, _ = load_splits(cfg, seq_len=4, vocab_size=256)
    assert bytes(train.tokens.tolist()) == b"alpha beta gamma\ndelta\n"


def test_local_jsonl_with_text_field(tmp_path):
    source = tmp_path / "docs.jsonl"
    rows = [{"body": "first doc", "id": 1}, {"body": "second ✓", "id": 2}, {"body": "third", "id": 3}]
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    cfg = DataConfig(source=str(source), text_field="body", val_fraction=0.0)
    assert list(documents(cfg)) == ["first doc", "second ✓", "third"]
    train, _ = load_splits(cfg, seq_len=4, vocab_size=256)
    assert bytes(train.tokens.tolist()).decode() == "first doc\nsecond ✓\nthird\n"


def test_jsonl_missing_field(tmp_path):
    source = tmp_path / "docs.jsonl"
    source.write_text(json.dumps({"text": "has text"}) + "\n" + json.dumps({"content": "no text"}) + "\n")
    cfg = DataConfig(source=str(source))
    with pytest.raises(ConfigError) as info:
        load_splits(cfg, seq_len=4, vocab_size=256)
    assert str(info.value) == f"{source}:2 has no field 'text'; set data.text_field"


def test_folder_of_files(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("from a")
    (tmp_path / "b" / "c.jsonl").write_text(json.dumps({"text": "from c"}) + "\n")
    (tmp_path / "d.md").write_text("from d")
    (tmp_path / "e.bin").write_bytes(b"\x00\x01 not text")
    cfg = DataConfig(source=str(tmp_path), val_fraction=0.0)
    assert list(documents(cfg)) == ["from a", "from c", "from d"]  # sorted paths, .bin skipped
    train, _ = load_splits(cfg, seq_len=4, vocab_size=256)
    assert bytes(train.tokens.tolist()) == b"from a\nfrom c\nfrom d\n"


def test_empty_folder_and_too_little_text(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=f"data.source '{empty}' holds no .txt/.md/.py/.jsonl/.parquet files"):
        load_splits(DataConfig(source=str(empty)), seq_len=4, vocab_size=256)
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(ConfigError) as info:
        load_splits(DataConfig(source=str(short), val_fraction=0.0), seq_len=16, vocab_size=256)
    assert str(info.value) == (f"data.source '{short}' has 5 tokens, too few for one window of "
                               "train.seq_len=16; add text or lower train.seq_len")


# ---------------------------------------------------------------- packing


def test_windows_are_seq_len_plus_one_and_overlap_by_one():
    split = Split(torch.arange(101), seq_len=10)
    assert split.num_windows == 10
    windows = split.windows(torch.arange(10))
    assert windows.shape == (10, 11)
    for i in range(10):
        assert windows[i].tolist() == list(range(10 * i, 10 * i + 11))
    assert torch.equal(windows[:-1, -1], windows[1:, 0])  # label of one window = input of the next
    assert torch.equal(split.windows(torch.tensor([7, 2])), windows[[7, 2]])
    assert Split(torch.arange(100), seq_len=10).num_windows == 9  # the 10th would lack its last label
    assert Split(torch.arange(5), seq_len=10).num_windows == 0


def test_windows_over_a_text_file(tmp_path):
    source = tmp_path / "corpus.txt"
    source.write_text(SAMPLE)
    train, _ = load_splits(DataConfig(source=str(source), val_fraction=0.0), seq_len=16, vocab_size=256)
    stream = list((SAMPLE + "\n").encode())
    assert train.num_windows == (len(stream) - 1) // 16
    windows = train.windows(torch.arange(train.num_windows))
    assert windows.shape == (train.num_windows, 17)
    for i in (0, 1, train.num_windows - 1):
        assert windows[i].tolist() == stream[16 * i: 16 * i + 17]


# ---------------------------------------------------------------- sampler


def test_batch_of_step_k_is_a_function_of_seed_data_and_k():
    a = GlobalBatchSampler(500, 16, seed=7)
    b = GlobalBatchSampler(500, 16, seed=7)
    later_first = [b.indices(k) for k in reversed(range(70))][::-1]  # any order of asking
    for k in range(70):  # 70 steps = 2.24 epochs
        got = a.next_indices()
        assert got.shape == (16,)
        assert torch.equal(got, later_first[k]), f"step {k}"
    assert not torch.equal(GlobalBatchSampler(500, 16, seed=8).indices(0), a.indices(0))
    assert not torch.equal(a.indices(0), a.indices(1))


@pytest.mark.parametrize("step", [0, 3, 31])
def test_rank_slices_rebuild_the_global_batch_for_any_dp(step):
    split = Split(torch.arange(4001), seq_len=8)
    sampler = GlobalBatchSampler(split.num_windows, 16, seed=1)
    batch = split.windows(sampler.indices(step))
    assert batch.shape == (16, 9)
    by_dp = {}
    for dp in (1, 2, 4, 8):
        slices = [rank_slice(batch, rank, dp) for rank in range(dp)]
        assert all(s.shape == (16 // dp, 9) for s in slices)
        by_dp[dp] = torch.cat(slices)
    assert torch.equal(by_dp[2], batch)
    assert torch.equal(by_dp[4], batch)
    assert torch.equal(by_dp[2], by_dp[4])
    # dp=4's ranks 0,1 together hold exactly dp=2's rank 0 (contiguous, not strided, slices).
    assert torch.equal(torch.cat([rank_slice(batch, 0, 4), rank_slice(batch, 1, 4)]), rank_slice(batch, 0, 2))


def test_epoch_boundary_gives_full_batches_each_window_once_per_epoch():
    sampler = GlobalBatchSampler(10, 4, seed=3)
    steps = [sampler.indices(k).tolist() for k in range(15)]  # 60 draws = 6 epochs
    assert all(len(s) == 4 for s in steps)
    flat = [i for s in steps for i in s]
    epochs = [flat[e * 10:(e + 1) * 10] for e in range(6)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(10))
    assert steps[2] == epochs[0][8:] + epochs[1][:2]  # step 2 crosses the first boundary
    assert len({tuple(e) for e in epochs}) > 1  # each epoch is shuffled afresh


def test_batch_larger_than_an_epoch():
    sampler = GlobalBatchSampler(3, 8, seed=0)
    batch = sampler.indices(0).tolist()
    assert len(batch) == 8
    assert sorted(batch[:3]) == sorted(batch[3:6]) == [0, 1, 2]
    following = sampler.indices(1).tolist()
    assert sorted(batch[6:] + following[:1]) == [0, 1, 2]


def test_sampler_resumes_exactly():
    uninterrupted = GlobalBatchSampler(37, 8, seed=11)
    expected = [uninterrupted.next_indices() for _ in range(15)]

    first = GlobalBatchSampler(37, 8, seed=11)
    for _ in range(5):
        first.next_indices()
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    assert state["step"] == 5

    resumed = GlobalBatchSampler(37, 8, seed=11)
    resumed.load_state_dict(state)
    assert resumed.step == 5
    for k in range(5, 15):
        assert torch.equal(resumed.next_indices(), expected[k]), f"step {k}"
    assert resumed.state_dict()["step"] == 15


@pytest.mark.parametrize("key, saved, current", [
    ("seed", 11, 12), ("num_windows", 37, 38), ("global_batch", 8, 16)])
def test_sampler_refuses_mismatched_state(key, saved, current):
    original = GlobalBatchSampler(37, 8, seed=11)
    original.next_indices()
    args = {"num_windows": 37, "global_batch": 8, "seed": 11}
    args[key] = current
    other = GlobalBatchSampler(**args)
    with pytest.raises(ConfigError) as info:
        other.load_state_dict(original.state_dict())
    assert str(info.value) == (f"the saved data position was made with {key}={saved}, this run has "
                               f"{current}; resume with the same data and batch settings")
    assert other.step == 0


def test_sampler_covers_windows_uniformly():
    # Over whole epochs every window is drawn the same number of times (no window is starved).
    sampler = GlobalBatchSampler(24, 6, seed=5)
    counts = torch.bincount(torch.cat([sampler.indices(k) for k in range(12)]), minlength=24)
    assert counts.tolist() == [3] * 24
