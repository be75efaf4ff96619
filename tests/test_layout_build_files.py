"""`fivefold layout --build`'s file inputs (issue 45). It writes nothing (its report goes to stdout)
and of model.init_from it reads only config.json (a rank's build takes the seeded initial values:
tools/rank_build.py), so the files that can fail it are that folder and its config.json: missing,
a file, cut short or unreadable, each one sentence with exit code 2."""

from __future__ import annotations

import errno

import pytest
from file_faults import refuse_reads

from fivefold.cli import main
from fivefold.models.hf.stream import make_random_hf_llama

REDO = "download or convert the Hugging Face folder again"
FOLDER = "pass a Hugging Face checkpoint folder (config.json + *.safetensors)"


@pytest.fixture
def hf(tmp_path):
    make_random_hf_llama(tmp_path / "hf", hidden=32, layers=2, heads=2, kv_heads=2, ffn=64, vocab=256)
    return tmp_path / "hf"


def _build(capsys, init_from) -> str:
    code = main(["layout", "tiny", "--build", "--rank", "1", "--nproc", "4", "--model.init_from", str(init_from)])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err and not out, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0].removeprefix("error: ")


def test_init_from_missing_or_a_file(hf, capsys):
    gone, config = hf.parent / "gone", hf / "config.json"
    assert _build(capsys, gone) == f"model.init_from='{gone}' needs a Hugging Face folder: {gone} is not a folder; {FOLDER}"
    assert _build(capsys, config) == (f"model.init_from='{config}' needs a Hugging Face folder: {config} is not a "
                                      f"folder; {FOLDER}")


def test_config_json_cut_short(hf, capsys):
    config = hf / "config.json"
    config.write_text(config.read_text()[:40])
    message = _build(capsys, hf)
    assert message.startswith(f"model.init_from='{hf}' needs a Hugging Face folder: {config} is not valid JSON (")
    assert message.endswith(f"); {REDO}")


def test_config_json_the_storage_will_not_read(hf, capsys, monkeypatch):
    config = hf / "config.json"
    refuse_reads(monkeypatch, config, errno.EIO)
    assert _build(capsys, hf) == (
        f"model.init_from='{hf}' needs a Hugging Face folder: cannot read {config}: the storage reported an "
        f"input/output error; check the disk or network file system (dmesg, the storage's health), then retry; {REDO}")
