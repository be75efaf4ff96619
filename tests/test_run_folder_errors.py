"""The run folder's own files (issue 45): the folders under log.dir a run writes into (hangs/,
tensorboard/, traces/, memory/, wandb/) are checked before any process starts, and a write there
that the OS refuses mid-run (a profiler trace, TensorBoard's event writer thread, the hang
watchdog and its records) is one sentence naming the file, the problem and the fix. The OS's
error is real where a path of the wrong kind gives it, and injected where only a full disk would."""

from __future__ import annotations

import errno
import tempfile

import pytest
import torch
from layouts import tiny_config
from file_faults import one_sentence

from fivefold.config.file_errors import FileProblem
from fivefold.train import hangs
from fivefold.train.trainer import train

FIX = "set log.dir to another folder (the checkpoints saved so far are intact)"


@pytest.mark.parametrize("folder, key, flags", [
    ("hangs", "the hang watchdog", []),
    ("traces", "log.profile_steps", ["--log.profile_steps", "1"]),
    ("wandb", "log.wandb", ["--log.wandb", "true", "--log.wandb_mode", "offline"]),
])
def test_a_file_where_a_run_folder_goes_is_refused_at_start(tmp_path, capsys, folder, key, flags):
    (tmp_path / folder).write_text("mine")
    assert one_sentence(capsys, "train", "tiny", "--dry-run", "--log.dir", tmp_path, *flags) == (
        f"{tmp_path / folder} is a file, not a folder, but {key} writes its files there; move it away or set "
        "log.dir to another folder")
    assert (tmp_path / folder).read_text() == "mine"


def test_a_run_folder_that_takes_no_files_is_refused_at_start(tmp_path, capsys, monkeypatch):
    traces = tmp_path / "traces"
    traces.mkdir()
    temporary = tempfile.TemporaryFile

    def refusing(*args, dir=None, **kwargs):  # as a folder this user may not write in (root may: injected)
        if dir is not None and str(dir) == str(traces):
            raise OSError(errno.EACCES, "Permission denied")
        return temporary(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", refusing)
    assert one_sentence(capsys, "train", "tiny", "--dry-run", "--log.dir", tmp_path, "--log.profile_steps", "1") == (
        f"cannot write in {traces}: permission denied; give this user access to it or set log.dir to another "
        "folder (log.profile_steps writes there)")


def test_a_trace_the_profiler_cannot_write(tmp_path, monkeypatch):
    """torch's profiler only logs a failed export and returns: the sentence still comes."""
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", lambda self, path: None)
    with pytest.raises(FileProblem) as err:
        train(tiny_config({"train": {"steps": 1}, "log": {"dir": str(tmp_path), "profile_steps": "1"}}))
    trace = tmp_path / "traces" / "rank0-step1.json"
    assert str(err.value) == (f"cannot write trace {trace}: the profiler wrote nothing there (its log line above says "
                              f"why; a full disk, most often); free space or {FIX}")


def test_hang_files_under_a_file(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    with pytest.raises(FileProblem) as err:
        hangs.StackWatchdog(a_file / "hangs", 0, 1.0)
    assert str(err.value) == (f"cannot write {a_file / 'hangs'}: a part of the path is a file, "
                              "not a folder; correct the path or set log.dir to another folder")
    # A timed-out rank's record that cannot be written is said beside the timeout, never instead of it.
    hangs.write_record(a_file / "hangs", 0, 3, TimeoutError("collective timed out"))
    assert capsys.readouterr().err == (
        f"warning: cannot write hang record {a_file / 'hangs'}: a part of the path is a file, not a folder; correct "
        "the path or set log.dir to another folder to have the next hang named\n")
    assert a_file.read_text() == "mine"


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # pytest's report of it
def test_tensorboard_events_onto_a_full_disk(tmp_path, monkeypatch, capfd):
    """The event writer's thread meets the full disk; the run ends with the sentence, and the thread's
    own traceback is not printed."""
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import record_writer

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    with pytest.raises(FileProblem) as err:
        train(tiny_config({"train": {"steps": 3}, "log": {"dir": str(tmp_path), "tensorboard": True}}))
    assert str(err.value) == f"cannot write {tmp_path / 'tensorboard'}: the disk is full; free space on that disk or {FIX}"
    assert "Traceback" not in capfd.readouterr().err
