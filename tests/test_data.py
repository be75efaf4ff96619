"""Data: corpus, tokenizers, packing into windows, the layout-independent, resumable sampler;
prepared (memory-mapped) folders, held-out documents and weighted mixtures."""

from __future__ import annotations

import hashlib
import json
import os
import string
import subprocess
import sys

import numpy as np
import pytest
import torch

from fivefold.config import ConfigError, DataConfig
from fivefold.data.batches import (ByteTokenizer, GlobalBatchSampler, HFTokenizer, Split, documents,
                                 load_splits, load_training_data, rank_slice)
from fivefold.config.validate_data import parse_mix
from fivefold.data.mixture import BLOCK
from fivefold.data.token_shards import TokenShards, held_out_ranges, prepared_splits

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
    code = ("import hashlib; from fivefold.config import DataConfig; from fivefold.data.batches import documents; "
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


def test_raw_parquet_and_saved_dataset_are_read_by_batches(tmp_path, monkeypatch):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fivefold.data import readers

    monkeypatch.setattr(readers, "BATCH_ROWS", 7)  # many batches and row groups, not one read
    texts = [f"row {i} ✓" for i in range(50)]
    pq.write_table(pa.table({"text": texts, "n": list(range(50))}), tmp_path / "t.parquet", row_group_size=16)
    datasets.Dataset.from_dict({"body": texts[::-1]}).save_to_disk(str(tmp_path / "saved"))
    assert list(documents(DataConfig(source=str(tmp_path / "t.parquet")))) == texts
    assert list(documents(DataConfig(source=str(tmp_path / "saved"), text_field="body"))) == texts[::-1]
    with pytest.raises(ConfigError) as info:
        list(documents(DataConfig(source=str(tmp_path / "saved"))))
    arrow = tmp_path / "saved" / "data-00000-of-00001.arrow"
    assert str(info.value) == f"{arrow} has no column 'text' (it has body); set data.text_field"


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
    with pytest.raises(ConfigError, match=f"data.source '{empty}' holds no .txt/.md/.py/.jsonl/.parquet/.arrow files"):
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


# ---------------------------------------------------------------- prepared folders and mixtures

def _prepare_jsonl(folder, docs, unit_bytes=4000):
    from fivefold.data.prepare import prepare

    source = folder.parent / (folder.name + ".jsonl")
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([str(source)], "byte", str(folder), workers=1, unit_bytes=unit_bytes, progress=False)
    return str(folder)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Two prepared folders of many shards: A's text is all 'a'-words, B's all 'b'-words, so a
    token's value tells which source it came from."""
    root = tmp_path_factory.mktemp("prepared")
    a = _prepare_jsonl(root / "A", [f"{'a' * (3 + i % 5)} " * (5 + i % 13) for i in range(600)])
    b = _prepare_jsonl(root / "B", [f"{'b' * (2 + i % 4)} " * (4 + i % 9) for i in range(400)])
    return a, b


def test_mapped_windows_equal_the_in_memory_packing(prepared):
    shards = TokenShards(prepared[0])
    assert len(shards.files) > 5
    mapped, _ = prepared_splits(prepared[0], seq_len=16, val_fraction=0.0)
    in_memory = Split(torch.from_numpy(shards.read(0, shards.num_tokens)), seq_len=16)
    assert mapped.num_windows == in_memory.num_windows
    picked = torch.tensor([0, 1, 5, in_memory.num_windows - 1, 77, 3])
    assert torch.equal(mapped.windows(picked), in_memory.windows(picked))  # windows crossing shard edges too


def test_held_out_split_is_whole_documents_spread_over_the_corpus(prepared):
    shards = TokenShards(prepared[0])
    train, val = held_out_ranges(shards, 0.1)
    assert held_out_ranges(shards, 0.1) == (train, val)  # reproducible
    starts = set(shards.document_starts.tolist()) | {shards.num_tokens}
    assert all(a in starts and b in starts for a, b in train + val)  # cut only at document starts
    covered = sorted(train + val)
    assert covered[0][0] == 0 and covered[-1][1] == shards.num_tokens
    assert all(x[1] == y[0] for x, y in zip(covered, covered[1:]))  # disjoint, together the whole stream
    held_docs = sum(int(np.searchsorted(shards.document_starts, b) - np.searchsorted(shards.document_starts, a))
                    for a, b in val)
    assert held_docs == 60  # 10% of 600 documents
    assert len(val) > 3  # many pieces, not one tail
    assert min(a for a, _ in val) < shards.num_tokens / 2  # some held-out text early in the corpus
    assert held_out_ranges(shards, 0.0) == ([(0, shards.num_tokens)], [])


def _batch_sets(a, b):
    cfg_one = DataConfig(source=a, val_fraction=0.05)
    cfg_mix = DataConfig(mix=f"{a}:0.7,{b}:0.3", val_fraction=0.05)
    return {"prepared": load_training_data(cfg_one, 16, 256, 8, seed=4)[0],
            "mixture": load_training_data(cfg_mix, 16, 256, 8, seed=4)[0]}


def test_mixture_token_shares_match_the_weights_over_1000_steps(prepared):
    batches = _batch_sets(*prepared)["mixture"]
    from_a = total = 0
    for step in range(1000):
        batch = batches.rank_batch(step)
        letters = batch[(batch != ord(" ")) & (batch != ord("\n"))]
        assert bool(((letters == ord("a")) | (letters == ord("b"))).all())
        rows_from_a = ((batch == ord("a")).any(1) & ~(batch == ord("b")).any(1)).sum()
        from_a += int(rows_from_a)
        total += batch.shape[0]
    assert abs(from_a / total - 0.7) < 0.01, from_a / total
    counted = batches.source_tokens(1000)
    assert counted == {prepared[0]: from_a * 16, prepared[1]: (total - from_a) * 16}
    # A weight stays a weight: 0.9 / 0.1 gives 0.9 / 0.1.
    skewed = load_training_data(DataConfig(mix=f"{prepared[0]}:9,{prepared[1]}:1"), 16, 256, 8, seed=4)[0]
    shares = skewed.source_tokens(1000)
    assert abs(shares[prepared[0]] / sum(shares.values()) - 0.9) < 0.01


def test_mixture_schedule_is_a_function_of_the_step(prepared):
    one = _batch_sets(*prepared)["mixture"]
    two = _batch_sets(*prepared)["mixture"]
    later_first = {k: two.rank_batch(k) for k in (BLOCK // 8 + 3, 700, 1, 0)}  # any order; across a block edge
    for k, batch in sorted(later_first.items()):
        assert torch.equal(one.rank_batch(k), batch), k
    assert not torch.equal(one.rank_batch(0), one.rank_batch(1))


def test_mix_settings_are_checked(prepared, tmp_path):
    a, b = prepared
    assert parse_mix(f"{a}:3,{b}:1") == [(a, 0.75), (b, 0.25)]
    for bad in (f"{a}", f"{a}:0", f"{a}:x,{b}:1", ":1"):
        with pytest.raises(ConfigError, match="must be FOLDER:WEIGHT with a weight > 0"):
            parse_mix(bad)
    with pytest.raises(ConfigError, match="names .* twice"):
        parse_mix(f"{a}:1,{a}:2")
    from fivefold.configure import load_config
    from fivefold.configure import validate

    with pytest.raises(ConfigError, match="data.mix and data.source=.* are both set"):
        validate(load_config(None, {"data": {"mix": f"{a}:1,{b}:1", "source": a}}))
    with pytest.raises(ConfigError) as info:
        validate(load_config(None, {"data": {"mix": f"{a}:1,{tmp_path}/none:1"}}))
    assert str(info.value) == (f"data.mix folder '{tmp_path}/none' does not exist; make it with "
                               f"`fivefold prepare SRC --out {tmp_path}/none`")
    with pytest.raises(ConfigError, match=f"'{tmp_path}' is not a prepared folder"):
        validate(load_config(None, {"data": {"mix": f"{a}:1,{tmp_path}:1"}}))


def _batches_on_rank(a, b, steps):
    """Each rank of a 4-rank world reads its own share for dp = 1, 2, 4 (ranks >= dp read nothing)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for label, batches in _batch_sets(a, b).items():
        for dp in (1, 2, 4):
            shares = [batches.rank_batch(k, rank, dp) if rank < dp else None for k in steps]
            gathered = [None] * 4
            dist.all_gather_object(gathered, shares)
            out[label, dp] = [torch.cat([gathered[r][i] for r in range(dp)]) for i in range(len(steps))]
    return out if rank == 0 else None


def test_batch_of_step_k_is_identical_for_dp_1_2_4(prepared):
    from ranks import run_on_ranks

    steps = [0, 1, 37, 600]
    results = run_on_ranks(4, _batches_on_rank, *prepared, steps, timeout_s=240)[0]
    for label, batches in _batch_sets(*prepared).items():
        want = [batches.rank_batch(k) for k in steps]  # one process reads the whole global batch
        for dp in (1, 2, 4):
            for k, got, expected in zip(steps, results[label, dp], want):
                assert torch.equal(got, expected), f"{label} dp={dp} step {k}"


def test_training_resumes_mid_epoch_bit_for_bit(prepared, tmp_path):
    """A mixture run saved at step 3 of 6 continues exactly (the epoch is far from over)."""
    from layouts import tiny_config

    from fivefold.train.trainer import train

    settings = {"data": {"mix": f"{prepared[0]}:0.6,{prepared[1]}:0.4"}, "log": {"every": 2, "dir": str(tmp_path)},
                "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64}}
    full = train(tiny_config({**settings, "checkpoint": {"dir": str(tmp_path / "ck"), "every": 3}}))
    batches = _batch_sets(*prepared)["mixture"]
    assert 6 * 8 < min(s.num_windows for s in batches.splits)  # mid-epoch for both sources
    resumed = train(tiny_config({**settings, "checkpoint": {"resume": str(tmp_path / "ck" / "step_00000003")}}))
    assert [r["step"] for r in resumed.records] == [4, 5, 6]
    assert resumed.losses == full.losses[3:]
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    per_source = [r["source_tokens"] for r in logged if "source_tokens" in r]
    assert len(per_source) == 3 + 2  # steps 2, 4, 6 of the first run; 4, 6 of the resumed one
    assert sum(per_source[2].values()) == 6 * 8 * 32  # cumulative inputs: steps x batch x seq_len


def test_mix_of_different_tokenizers_is_refused(prepared, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from fivefold.configure import load_config
    from fivefold.data.prepare import prepare
    from fivefold.configure import validate

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "words.json"))
    (tmp_path / "w.jsonl").write_text(json.dumps({"text": "a a"}) + "\n")
    prepare([str(tmp_path / "w.jsonl")], str(tmp_path / "words.json"), str(tmp_path / "W"), workers=1, progress=False)
    with pytest.raises(ConfigError) as info:
        validate(load_config(None, {"data": {"mix": f"{prepared[0]}:1,{tmp_path}/W:1"}}))
    assert str(info.value).startswith(f"data.mix folders were prepared with different tokenizers ({prepared[0]}: "
                                      f"byte, {tmp_path}/W: words.json sha256 ")
    assert str(info.value).endswith("); prepare them all with the same one")
