"""`fivefold prepare`: token shards, document index and manifest from text / jsonl / parquet / Arrow;
worker-count-independent, resumable byte for byte after a kill, one sentence for each bad input."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fivefold.cli import main
from fivefold.config import ConfigError
from fivefold.data.batches import HFTokenizer
from fivefold.data.prepare import prepare
from fivefold.data.token_shards import TokenShards

DOCS = [f"document {i}: " + "héllo wörld ✓ " * (i % 7) + "end" for i in range(300)]


def _folder_bytes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """One source of each kind: jsonl, text, parquet (3 row groups), a `datasets.save_to_disk` folder."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("corpus")
    (root / "a.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS[:100])))
    (root / "b.txt").write_text("\n".join(DOCS[100:150]))
    pq.write_table(pa.table({"text": DOCS[150:250]}), root / "c.parquet", row_group_size=40)
    datasets.Dataset.from_dict({"text": DOCS[250:]}).save_to_disk(str(root / "saved"))
    (root / "small").mkdir()
    for i in range(5):  # small files: grouped into one unit
        (root / "small" / f"{i}.md").write_text(f"# note {i}\n")
    return root


def _sources(root: Path) -> list[str]:
    return [str(root / "a.jsonl"), str(root / "b.txt"), str(root / "c.parquet"), str(root / "saved"),
            str(root / "small")]


def _expected_documents() -> list[str]:
    # Documents in source order; a text file is one document; each is followed by a newline.
    return ([d + "\n" for d in DOCS[:100]] + ["\n".join(DOCS[100:150]) + "\n"] + [d + "\n" for d in DOCS[150:]]
            + [f"# note {i}\n\n" for i in range(5)])


def test_every_kind_of_source_tokenized_in_order(corpus, tmp_path):
    out = tmp_path / "out"
    manifest = prepare(_sources(corpus), "byte", str(out), workers=1, unit_bytes=2000, progress=False)
    docs = _expected_documents()
    stream = b"".join(d.encode() for d in docs)
    shards = TokenShards(str(out))
    assert shards.read(0, shards.num_tokens).tobytes() == np.frombuffer(stream, np.uint8).astype(np.int64).tobytes()
    starts = np.cumsum([0] + [len(d.encode()) for d in docs[:-1]])
    assert shards.document_starts.tolist() == starts.tolist()
    assert manifest["tokens"] == len(stream) and manifest["documents"] == len(docs)
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"] == {"name": "byte", "vocab_size": 256}
    assert {Path(s["path"]).name for s in manifest["sources"]} == {"a.jsonl", "b.txt", "c.parquet",
                                                                  "data-00000-of-00001.arrow",
                                                                  *(f"{i}.md" for i in range(5))}
    assert all(s["bytes"] == Path(s["path"]).stat().st_size for s in manifest["sources"])
    kinds = [p["kind"] for s in manifest["shards"] for p in s["pieces"]]
    assert kinds.count("jsonl") > 1 and kinds.count("text") > 1 and kinds.count("parquet") > 1  # cut into units
    assert [Path(p["path"]).name for p in manifest["shards"][-1]["pieces"]] == [f"{i}.md" for i in range(5)]
    assert sorted(p.name for p in out.iterdir()) == sorted(["manifest.json", "documents.npy"] +
                                                           [s["file"] for s in manifest["shards"]])


def test_globs_and_folders(corpus, tmp_path):
    by_glob = prepare([str(corpus / "*.jsonl"), str(corpus / "*.txt")], "byte", str(tmp_path / "g"),
                      workers=1, progress=False)
    by_files = prepare([str(corpus / "a.jsonl"), str(corpus / "b.txt")], "byte", str(tmp_path / "f"),
                       workers=1, progress=False)
    assert by_glob["tokens"] == by_files["tokens"] and by_glob["documents"] == by_files["documents"] == 101
    with pytest.raises(ConfigError, match=r"'.*\*.csv' matches no file"):
        prepare([str(corpus / "*.csv")], "byte", str(tmp_path / "x"), workers=1, progress=False)


def test_hf_tokenizer_uint16_and_uint32(corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for d in DOCS for w in d.replace(":", " ").split()})
    for size, dtype in ((1000, "uint16"), (70_000, "uint32")):
        vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
        vocab.update({f"filler{i}": len(vocab) + i for i in range(size - len(vocab))})
        tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        path = tmp_path / f"tok{size}.json"
        tok.save(str(path))
        manifest = prepare([str(corpus / "a.jsonl")], str(path), str(tmp_path / f"o{size}"), workers=1,
                           unit_bytes=3000, progress=False)
        assert manifest["dtype"] == dtype and manifest["tokenizer"]["vocab_size"] == size
        assert manifest["tokenizer"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        reference = HFTokenizer(str(path))
        expected = np.concatenate([reference.encode(d + "\n") for d in DOCS[:100]])
        shards = TokenShards(str(tmp_path / f"o{size}"))
        assert shards.read(0, shards.num_tokens).tolist() == expected.tolist()
        assert np.dtype(shards.dtype) == np.dtype(dtype)


def test_worker_count_does_not_change_a_byte(corpus, tmp_path):
    one = prepare(_sources(corpus), "byte", str(tmp_path / "one"), workers=1, unit_bytes=2000, progress=False)
    two = prepare(_sources(corpus), "byte", str(tmp_path / "two"), workers=2, unit_bytes=2000, progress=False)
    assert len(one["shards"]) > 4
    assert _folder_bytes(tmp_path / "one") == _folder_bytes(tmp_path / "two")
    assert one == two


def test_interrupted_prepare_resumes_to_identical_output(corpus, tmp_path):
    """A real SIGKILL between shards; the rerun keeps finished shards and matches a clean run."""
    clean = tmp_path / "clean"
    prepare(_sources(corpus), "byte", str(clean), workers=1, unit_bytes=2000, progress=False)
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "fivefold", "prepare", *_sources(corpus), "--out", str(out), "--workers", "1"]
    code = ("import sys, fivefold.data.prepare as p; p.UNIT_BYTES = 2000; from fivefold.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    env = dict(os.environ, FIVEFOLD_DEBUG_PREPARE_PAUSE_S="0.3")
    proc = subprocess.Popen([sys.executable, "-c", code, *command[3:]], env=env)
    deadline = time.monotonic() + 60
    while len(list(out.glob("shard_*.bin"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("shard_*.bin")}
    assert 3 <= len(kept) < len(json.loads((clean / "manifest.json").read_text())["shards"])
    assert not (out / "manifest.json").exists()
    (out / ".shard_00099.bin.tmp").write_bytes(b"half a shard")  # a write cut short is never trusted
    prepare(_sources(corpus), "byte", str(out), workers=1, unit_bytes=2000, progress=False)
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept  # not redone
    assert _folder_bytes(out) == _folder_bytes(clean)
    # Once finished, the same command does nothing; other inputs are refused, not mixed in.
    prepare(_sources(corpus), "byte", str(out), workers=1, unit_bytes=2000, progress=False)
    assert _folder_bytes(out) == _folder_bytes(clean)
    with pytest.raises(ConfigError, match="already holds prepared data from other sources"):
        prepare([str(corpus / "a.jsonl")], "byte", str(out), workers=1, unit_bytes=2000, progress=False)


BAD_INPUTS = {
    "malformed json": ("bad.jsonl", b'{"text": "fine"}\n{"text": "cut\n', "{p}:2 is not valid JSON (Unterminated string "
                       "starting at); fix or remove that line"),
    "missing field": ("bad.jsonl", b'{"text": "a"}\n\n{"body": "b"}\n', "{p}:3 has no field 'text'; set --text-field"),
    "conversations without --chat": ("chat.jsonl", b'{"messages": [{"role": "user", "content": "hi"}]}\n',
                                     "{p}:1 holds a conversation ('messages'), not plain text; prepare it with "
                                     "--chat --seq-len N (chat templates and loss masks)"),
    "prompt and completion without --chat": ("pc.jsonl", b'{"prompt": "q", "completion": "a"}\n',
                                             "{p}:1 holds a conversation ('prompt'), not plain text; prepare it "
                                             "with --chat --seq-len N (chat templates and loss masks)"),
    "null field": ("bad.jsonl", b'{"text": "a"}\n{"text": null}\n', "{p}:2 has a null 'text' field; give every "
                   "record text, or set --text-field"),
    "number field": ("bad.jsonl", b'{"text": 7}\n', "{p}:1 field 'text' is int, not text; set --text-field"),
    "not an object": ("bad.jsonl", b'{"text": "a"}\n["text"]\n', "{p}:2 is not a JSON object; each line must be "
                      "an object with a 'text' field"),
    "jsonl not utf-8": ("bad.jsonl", b'{"text": "a"}\n{"text": "\xff\xfe"}\n', "{p}:2 is not UTF-8 text (byte 24); "
                        "convert the file to UTF-8 or leave it out"),
    "text not utf-8": ("bad.txt", b"line one\nline two\nbad \xc3\x28 here\n", "{p}:3 is not UTF-8 text (byte 22); "
                       "convert the file to UTF-8 or leave it out"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gets_one_sentence(case, tmp_path, capsys):
    name, content, sentence = BAD_INPUTS[case]
    path = tmp_path / name
    path.write_bytes(content)
    code = main(["prepare", str(path), "--out", str(tmp_path / "out"), "--workers", "1"])
    assert code == 2
    assert capsys.readouterr().err == f"error: {sentence.format(p=path.resolve())}\n"


def test_bad_parquet_gets_one_sentence(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    cases = {"nulls.parquet": (pa.table({"text": ["a", "b", None]}), "{p} row 3 has a null 'text' field; give "
                               "every record text, or set --text-field"),
             "other.parquet": (pa.table({"body": ["a"], "id": [1]}), "{p} has no column 'text' (it has body, id); "
                               "set --text-field"),
             "ints.parquet": (pa.table({"text": [1, 2]}), "{p} column 'text' holds int64, not text; set --text-field")}
    for name, (table, sentence) in cases.items():
        pq.write_table(table, tmp_path / name)
        assert main(["prepare", str(tmp_path / name), "--out", str(tmp_path / f"out_{name}"), "--workers", "1"]) == 2
        assert capsys.readouterr().err == f"error: {sentence.format(p=(tmp_path / name).resolve())}\n"


def test_error_in_a_worker_process_reaches_the_cli_as_one_sentence(tmp_path):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(json.dumps({"text": "fine"}) + "\n")
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"content": "x"}) + "\n")
    done = subprocess.run([sys.executable, "-m", "fivefold", "prepare", str(good), str(bad), "--out",
                           str(tmp_path / "out"), "--workers", "2"], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr == f"error: {bad.resolve()}:2 has no field 'text'; set --text-field\n"
    assert "Traceback" not in done.stdout + done.stderr


def test_cli_usage_and_summary(corpus, tmp_path, capsys):
    assert main(["prepare", str(corpus / "a.jsonl")]) == 2
    assert "usage: fivefold prepare SRC..." in capsys.readouterr().err
    assert main(["prepare", str(corpus / "a.jsonl"), "--out", str(tmp_path / "o"), "--workers", "1"]) == 0
    assert capsys.readouterr().out.startswith(f"prepared {tmp_path / 'o'}: ")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert main(["prepare", str(corpus / "a.jsonl"), "--out", str(tmp_path / "busy")]) == 2
    assert "is not empty and holds no prepare" in capsys.readouterr().err
