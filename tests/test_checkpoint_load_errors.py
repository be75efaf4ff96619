"""Loading a checkpoint whose files the storage will not read or that were cut short (issue 45): a
manifest cut short, a state.json the OS refuses (EIO, EACCES: injected at the read, as the test may
run as root), `latest` naming a folder that is gone or `latest` itself unreadable. Each is one
sentence naming the file, the problem and the fix; under `checkpoint.resume = auto` the newest
intact checkpoint is still taken, with a warning naming the one skipped.

A .distcp file cut short, a missing or flipped file and a shape that does not fit are
tests/test_checkpoint.py's; here a cut .distcp only shows the fallback of `auto`."""

from __future__ import annotations

import errno
import shutil

import pytest
from layouts import tiny_config
from file_faults import refuse_reads

from fivefold.config import ConfigError
from fivefold.checkpoint import save_load as checkpoint
from fivefold.train.trainer import train

EIO = ("the storage reported an input/output error; check the disk or network file system (dmesg, the storage's "
       "health), then retry")
ANOTHER = "resume from another checkpoint (e.g. checkpoint.resume=auto takes the newest whole one)"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    train(tiny_config({"train": {"steps": 2}, "checkpoint": {"dir": str(root), "every": 1}}))
    return root


@pytest.fixture
def root(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _resolve(root, resume):
    return checkpoint.resolve(tiny_config({"checkpoint": {"dir": str(root), "resume": str(resume)}}))


def _refused(root, resume) -> str:
    with pytest.raises(ConfigError) as err:
        _resolve(root, resume)
    return str(err.value)


def _cut_manifest(step):
    text = (step / "manifest.json").read_text()
    (step / "manifest.json").write_text(text[: len(text) // 2])


def _cut_distcp(step):
    data = (step / "__0_0.distcp").read_bytes()
    (step / "__0_0.distcp").write_bytes(data[: len(data) // 2])


def _latest_names_a_missing_folder(step):
    (step.parent / "latest").write_text("step_00000009\n")


DAMAGE = {  # how the newest checkpoint (or `latest`) is damaged -> what the warning says of it
    "manifest cut short": (_cut_manifest, "manifest.json is unreadable ("),
    "distcp cut short": (_cut_distcp, "__0_0.distcp is "),
    "latest names a missing folder": (_latest_names_a_missing_folder, "'latest' names it, but it does not exist"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_auto_falls_back_to_the_previous_intact_checkpoint(root, capsys, damage):
    make, said = DAMAGE[damage]
    make(root / "step_00000002")
    # `latest` naming a missing step_9 leaves step 2 the newest intact one
    skipped, previous = ("step_00000009", "step_00000002") if "latest" in damage else ("step_00000002", "step_00000001")
    assert _resolve(root, "auto") == root / previous
    warning = capsys.readouterr().err.strip()
    assert warning.startswith(f"warning: skipped damaged checkpoint {root / skipped} ({said}"), warning
    assert "\n" not in warning and warning.endswith(f"; resuming from {root / previous}")


def test_a_manifest_cut_short_named_when_resumed_by_path(root):
    step = root / "step_00000002"
    _cut_manifest(step)
    message = _refused(root, step)
    assert message.startswith(f"checkpoint {step} is damaged: manifest.json is unreadable (")
    assert message.endswith(f"); {ANOTHER}") and "\n" not in message


@pytest.mark.parametrize("code, said", [(errno.EIO, EIO),
                                        (errno.EACCES, "permission denied; give this user access to it")],
                         ids=["EIO", "EACCES"])
def test_a_state_json_the_storage_will_not_read(root, monkeypatch, capsys, code, said):
    step = root / "step_00000002"
    refuse_reads(monkeypatch, step / "state.json", code)
    assert _refused(root, step) == f"checkpoint {step} is damaged: state.json cannot be read ({said}); {ANOTHER}"
    assert _resolve(root, "auto") == root / "step_00000001"  # as with any damaged newest checkpoint
    assert capsys.readouterr().err == (f"warning: skipped damaged checkpoint {step} (state.json cannot be read "
                                       f"({said})); resuming from {root / 'step_00000001'}\n")
    with pytest.raises(ConfigError) as err:  # a read after the choice (convert, generate, export)
        checkpoint.read_state(step)
    assert str(err.value) == (f"cannot read checkpoint file {step / 'state.json'}: {said} or resume from another "
                              "checkpoint (checkpoint.resume = auto takes the newest whole one)")


def test_latest_the_storage_will_not_read(root, monkeypatch):
    refuse_reads(monkeypatch, root / "latest", errno.EIO)
    assert _refused(root, "auto") == (f"cannot read {root / 'latest'}: {EIO} or set checkpoint.resume to a "
                                      "step_N folder")


def test_latest_names_a_missing_folder_and_nothing_else_is_left(root):
    _latest_names_a_missing_folder(root / "step_00000002")
    for step in ("step_00000001", "step_00000002"):
        shutil.rmtree(root / step)
    assert _refused(root, "auto") == (
        f"no whole checkpoint under {root}: {root / 'step_00000009'} ('latest' names it, but it does not exist); "
        "restore one from a copy, or start afresh with checkpoint.resume=none and another checkpoint.dir")


def test_a_state_json_cut_short_read_after_the_choice(root):
    """convert, generate and export read state.json of the folder they were given, without resolve."""
    step = root / "step_00000002"
    (step / "state.json").write_text((step / "state.json").read_text()[:30])
    with pytest.raises(ConfigError) as err:
        checkpoint.read_state(step)
    message = str(err.value)
    assert message.startswith(f"checkpoint file {step / 'state.json'} is not valid JSON (")
    assert message.endswith("): the checkpoint is damaged; resume from another checkpoint (checkpoint.resume = auto "
                            "takes the newest whole one)") and "\n" not in message
