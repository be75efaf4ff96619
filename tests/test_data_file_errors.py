"""A prepared folder that was damaged after `fivefold prepare` (a shard cut short by a full disk or a
copy, a file missing or replaced by a folder, a document index that is truncated, a manifest the OS
will not read) is refused when the data is opened, before the first step, in one sentence naming
the file, what is wrong and the fix (issue 45). Nothing in the folder is changed by the check."""

from __future__ import annotations

import errno
import json
import shutil

import numpy as np
import pytest
from file_faults import refuse_reads

from fivefold.cli import main
from fivefold.config.file_errors import FileProblem
from fivefold.config.manifest import read_manifest
from fivefold.data.prepare import prepare
from fivefold.data.token_shards import DOCUMENTS, TokenShards


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared")
    (root / "a.txt").write_text("".join(f"document {i} says something about the weather.\n\n" for i in range(400)))
    (root / "b.txt").write_text("".join(f"another text, number {i}, about cooking.\n\n" for i in range(400)))
    prepare([str(root / "a.txt"), str(root / "b.txt")], "byte", str(root / "out"), workers=1, unit_bytes=8000,
            progress=False)
    return root / "out"


@pytest.fixture
def folder(prepared, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(prepared, copy)
    return copy


def _fix(folder):
    return f"prepare the folder again (`fivefold prepare SRC... --out {folder}`) or restore it from a copy"


def _refused(folder) -> str:
    with pytest.raises(FileProblem) as err:
        TokenShards(str(folder))
    return str(err.value)


def _first_shard(folder):
    manifest = json.loads((folder / "manifest.json").read_text())
    return folder / manifest["shards"][0]["file"], manifest["shards"][0]["tokens"], manifest


def test_the_undamaged_folder_opens(folder):
    shards = TokenShards(str(folder))
    assert len(shards.files) > 1 and shards.num_tokens > 0  # the cases below damage a folder that works


def test_truncated_shard(folder):
    shard, tokens, manifest = _first_shard(folder)
    size = tokens * np.dtype(manifest["dtype"]).itemsize
    with open(shard, "r+b") as f:
        f.truncate(size - 7)
    assert _refused(folder) == (
        f"token shard {shard} is {size - 7} bytes, but {folder / 'manifest.json'} lists {tokens} tokens ({size} "
        f"bytes): it was cut short or changed after it was prepared; {_fix(folder)}")
    assert shard.stat().st_size == size - 7  # looked at, not touched


def test_missing_shard(folder):
    shard, _, _ = _first_shard(folder)
    shard.unlink()
    assert _refused(folder) == (f"token shard {shard} does not exist; it is listed in "
                                f"{folder / 'manifest.json'}; {_fix(folder)}")


def test_shard_replaced_by_a_folder(folder):
    shard, _, _ = _first_shard(folder)
    shard.unlink()
    shard.mkdir()
    assert _refused(folder) == (f"token shard {shard} is a folder, not a file; it is listed in "
                                f"{folder / 'manifest.json'}; {_fix(folder)}")


def test_truncated_loss_mask(folder):
    shard, tokens, manifest = _first_shard(folder)
    mask = shard.with_name(shard.name[:-len(".bin")] + ".mask.bin")
    manifest["loss_mask"] = True
    (folder / "manifest.json").write_text(json.dumps(manifest))
    for entry in manifest["shards"]:  # whole masks for every shard but the first, which is cut short
        n = entry["tokens"] - (entry is manifest["shards"][0])
        (folder / entry["file"]).with_name(entry["file"][:-len(".bin")] + ".mask.bin").write_bytes(b"\x01" * n)
    assert _refused(folder) == (
        f"loss mask {mask} is {tokens - 1} bytes, but {folder / 'manifest.json'} lists {tokens} tokens ({tokens} "
        f"bytes): it was cut short or changed after it was prepared; {_fix(folder)}")


def test_truncated_document_index(folder):
    docs = folder / DOCUMENTS
    docs.write_bytes(docs.read_bytes()[:100])
    message = _refused(folder)
    assert message.startswith(f"{docs} is not a valid document index (.npy) (")
    assert message.endswith(f"); {_fix(folder)}")


def test_document_index_of_another_folder(folder):
    docs = folder / DOCUMENTS
    manifest = json.loads((folder / "manifest.json").read_text())
    np.save(docs, np.arange(3, dtype=np.int64))
    assert _refused(folder) == (f"document index {docs} holds 3 entries, but {folder / 'manifest.json'} lists "
                                f"{manifest['documents']} documents; {_fix(folder)}")


@pytest.mark.parametrize("code, words", [
    (errno.EACCES, "permission denied; give this user access to it"),
    (errno.EIO, "the storage reported an input/output error; check the disk or network file system (dmesg, "
                "the storage's health), then retry")])
def test_manifest_the_os_will_not_read(folder, monkeypatch, code, words):
    # Injected: a chmod does not stop root, who runs many CI containers.
    manifest = folder / "manifest.json"
    refuse_reads(monkeypatch, manifest, code)
    with pytest.raises(FileProblem) as err:
        read_manifest(str(folder))
    assert str(err.value) == (f"cannot read {manifest}: {words} or prepare the folder again "
                              f"(`fivefold prepare SRC... --out {folder}`)")


def test_a_run_on_a_truncated_shard_stops_before_its_first_step(folder, capsys):
    shard, tokens, _ = _first_shard(folder)
    shard.write_bytes(shard.read_bytes()[:10])
    code = None
    try:
        code = main(["train", "--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "2",
                     "--model.n_kv_heads", "1", "--model.ffn_dim", "64", "--train.steps", "1", "--train.seq_len", "16",
                     "--train.global_batch", "2", "--log.progress", "false", "--data.source", str(folder)])
    except SystemExit as done:
        code = done.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [f"error: token shard {shard} is 10 bytes, but {folder / 'manifest.json'} "
                                        f"lists {tokens} tokens ({2 * tokens} bytes): it was cut short or changed "
                                        f"after it was prepared; {_fix(folder)}"]
