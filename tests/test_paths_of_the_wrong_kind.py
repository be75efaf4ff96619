"""Every command's inputs and outputs given a path of the wrong kind (a file where a folder is
expected and the reverse, a path under a file, an output folder holding someone else's files), and
the run's own files on a disk that fills up (metrics.jsonl, a prepare's shards): one sentence
naming the path, the problem and the fix, exit code 2, and nothing of the user's touched (issue 45).
All in this process: the checks run before any rank starts."""

from __future__ import annotations

import errno

import pytest
from layouts import tiny_config
from file_faults import one_sentence

from fivefold.cli import main
from fivefold.config.file_errors import FileProblem
from fivefold.train import metrics
from fivefold.data import prepare as prepare_module
from fivefold.train.trainer import train


@pytest.fixture
def places(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    a_folder = tmp_path / "folder"
    a_folder.mkdir()
    (a_folder / "notes.txt").write_text("mine")
    yield tmp_path, a_file, a_folder
    assert a_file.read_text() == "mine" and [p.name for p in a_folder.iterdir()] == ["notes.txt"]


def test_prepare_out(places, capsys):
    tmp, a_file, a_folder = places
    fix = "give prepare a folder to create, or its earlier --out"
    assert one_sentence(capsys, "prepare", a_file, "--out", a_file) == f"--out {a_file} is a file, not a folder; {fix}"
    assert one_sentence(capsys, "prepare", a_file, "--out", a_file / "data") == (
        f"--out {a_file / 'data'} is under {a_file}, which is a file, not a folder; {fix}")
    assert one_sentence(capsys, "prepare", a_file, "--out", a_folder) == (
        f"--out {a_folder} is not empty and holds no prepare; choose a new or empty folder")


def test_prepare_onto_a_full_disk_continues_when_run_again(places, monkeypatch, capsys):
    tmp, a_file, _ = places
    out = tmp / "data"
    write_index = prepare_module._write_document_index

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prepare_module, "_write_document_index", full)
    assert one_sentence(capsys, "prepare", a_file, "--out", out, "--workers", "1") == (
        f"cannot write {out}: the disk is full; free space on that disk or choose another --out; finished shards "
        "are kept and the same command continues where it stopped")
    monkeypatch.setattr(prepare_module, "_write_document_index", write_index)
    assert main(["prepare", str(a_file), "--out", str(out), "--workers", "1"]) == 0
    assert (out / "manifest.json").is_file()


def test_report_paths(places, capsys):
    tmp, a_file, a_folder = places
    assert one_sentence(capsys, "report", a_file) == f"report RUN_DIR {a_file} is a file, not a folder; give the log.dir of a run"
    run = tmp / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (run / "report").write_text("mine")
    assert one_sentence(capsys, "report", run) == (
        f"report folder {run / 'report'} is a file, not a folder; move it away: fivefold report draws there")
    assert (run / "report").read_text() == "mine"


def test_plot_outputs(places, capsys):
    tmp, a_file, a_folder = places
    fix = "give the path of a .png file to write"
    assert one_sentence(capsys, "plan", "tiny", "--layout", "dp=1", "--plot", a_folder) == \
        f"--plot {a_folder} is a folder, not a file; {fix}"
    assert one_sentence(capsys, "plan", "tiny", "--layout", "dp=1", "--plot", a_file / "m.png") == \
        f"--plot {a_file / 'm.png'} is under {a_file}, which is a file, not a folder; {fix}"
    assert one_sentence(capsys, "viz", "schedule", "--pp", "2", "--out", a_folder) == \
        f"--out {a_folder} is a folder, not a file; {fix}"


def test_generate_and_train_inputs(places, capsys):
    tmp, a_file, a_folder = places
    assert one_sentence(capsys, "generate", a_file, "--prompt", "hi") == (
        f"generate CHECKPOINT {a_file} is a file, not a folder; give a step_N folder, a checkpoint root or a "
        "Hugging Face folder")
    assert one_sentence(capsys, "train", "--dry-run", "--checkpoint.resume", a_file) == (
        f"checkpoint.resume='{a_file}' is a file, not a folder; pass a step_N folder, a checkpoint root, 'auto' "
        "or 'none'")
    assert one_sentence(capsys, "train", "--dry-run", "--checkpoint.resume", a_folder) == (
        f"checkpoint.resume='{a_folder}' is not a checkpoint: it has no state.json and no 'latest' marker; pass "
        "a step_N folder, a checkpoint root, 'auto' or 'none'")


class _FullDisk:
    """A file whose every write the disk refuses (as a full disk does, with no file name)."""

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        pass


def test_metrics_onto_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "open", lambda *args, **kwargs: _FullDisk(), raising=False)
    with pytest.raises(FileProblem) as err:
        train(tiny_config({"train": {"steps": 1}, "log": {"dir": str(tmp_path)}}))
    assert str(err.value) == (f"cannot write {tmp_path / 'metrics.jsonl'}: the disk is full; free space on that "
                              "disk or set log.dir to another folder (the checkpoints saved so far are intact)")
