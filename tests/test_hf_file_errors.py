"""Hugging Face folders that are damaged or in the wrong place (issue 45): a safetensors file cut
short, an index that is not one, a config.json the OS will not read, an export the disk cannot hold,
and `fivefold convert` given paths of the wrong kind, each end in one sentence naming the file,
the problem and the fix; what was there before is left as it was."""

from __future__ import annotations

import errno
import shutil

import pytest
from file_faults import refuse_reads

from fivefold.cli import main
from fivefold.config.file_errors import FileProblem
from fivefold.models.hf import stream as hf_stream
from fivefold.models.hf.stream import INDEX, HFBoxes, make_random_hf_llama
from fivefold.tools.convert import convert
from fivefold.train import export

REDO = "download or convert the Hugging Face folder again"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A two-shard Hugging Face folder (with an index) and the fivefold checkpoint converted from it."""
    root = tmp_path_factory.mktemp("hf")
    make_random_hf_llama(root / "hf", hidden=32, layers=2, heads=2, kv_heads=1, ffn=64, vocab=64,
                         max_shard_bytes=20_000)
    convert(root / "hf", root / "ckpt")
    return root


@pytest.fixture
def hf(made, tmp_path):
    shutil.copytree(made / "hf", tmp_path / "hf")
    return tmp_path / "hf"


def _refused(folder) -> str:
    with pytest.raises(FileProblem) as err:
        HFBoxes(folder)
    return str(err.value)


def test_the_undamaged_folder_reads(hf):
    assert (hf / INDEX).is_file() and len(list(hf.glob("*.safetensors"))) > 1  # damaged copies below
    assert HFBoxes(hf).shapes


def test_truncated_safetensors(hf):
    shard = sorted(hf.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    assert _refused(hf) == (f"{shard} is not a valid safetensors file (Error while deserializing header: "
                            f"incomplete metadata, file not fully covered); {REDO}")


def test_index_cut_short(hf):
    (hf / INDEX).write_text((hf / INDEX).read_text()[:50])
    message = _refused(hf)
    assert message.startswith(f"{hf / INDEX} is not a valid index ({INDEX} with a weight_map) (")
    assert message.endswith(f"); {REDO}")


def test_index_without_a_weight_map(hf):
    (hf / INDEX).write_text('{"metadata": {}}')
    assert _refused(hf) == f"{hf / INDEX} is not a valid index ({INDEX} with a weight_map) ('weight_map'); {REDO}"


def test_config_json_the_os_will_not_read(hf, monkeypatch):
    config = hf / "config.json"
    refuse_reads(monkeypatch, config, errno.EIO)
    assert _refused(hf) == (f"cannot read {config}: the storage reported an input/output error; check the disk "
                            f"or network file system (dmesg, the storage's health), then retry; {REDO}")


def test_export_onto_a_full_disk_says_so_and_keeps_the_checkpoint(made, tmp_path, monkeypatch):
    before = sorted((p.name, p.stat().st_size) for p in (made / "ckpt").iterdir())

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf_stream, "_write_safetensors", full)
    with pytest.raises(FileProblem) as err:
        export.checkpoint_to_hf(made / "ckpt", tmp_path / "out")
    assert str(err.value) == (f"cannot write {tmp_path / 'out'}: the disk is full; free space on that disk or "
                              f"choose another folder to export to; the checkpoint {made / 'ckpt'} is unchanged")
    assert sorted((p.name, p.stat().st_size) for p in (made / "ckpt").iterdir()) == before


def _convert(capsys, *args) -> str:
    code = main(["convert", *map(str, args)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0].removeprefix("error: ")


def test_convert_paths_of_the_wrong_kind(made, tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    src_fix = "give a Hugging Face folder or a fivefold checkpoint folder"
    assert _convert(capsys, a_file, tmp_path / "o") == f"convert SRC {a_file} is a file, not a folder; {src_fix}"
    assert _convert(capsys, tmp_path / "nowhere", tmp_path / "o") == \
        f"convert SRC {tmp_path / 'nowhere'} does not exist; {src_fix}"
    assert _convert(capsys, made / "hf", a_file) == f"convert DST {a_file} is a file, not a folder; give a new folder to write"
    assert _convert(capsys, made / "hf", a_file / "out") == (
        f"convert DST {a_file / 'out'} is under {a_file}, which is a file, not a folder; give a new folder to write")
    assert _convert(capsys, made / "ckpt", foreign) == (
        f"convert DST {foreign} already holds files that fivefold did not write; give a new or empty folder "
        "(give a new folder to write)")
    assert a_file.read_text() == "mine" and (foreign / "notes.txt").read_text() == "mine"
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
