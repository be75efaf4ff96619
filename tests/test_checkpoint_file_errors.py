"""A checkpoint save the storage refuses (a full disk, an I/O error, a denied permission) ends the
run with one sentence naming the checkpoint, the problem and the fix, and loses nothing: the
previous checkpoint stays whole, `latest` still names it, and no half-written folder is left for
`checkpoint.resume = auto` to mistake for a checkpoint (issue 45).

The storage's error is injected where DCP writes a tensor (every rank's file goes through it) or
where rank 0 writes the manifest, so the test runs as root too, where permissions do not deny."""

from __future__ import annotations

import errno

import pytest
import torch.distributed.checkpoint.filesystem as dcp_files
from layouts import tiny_config

from fivefold.config.file_errors import FileProblem
from fivefold.checkpoint import save_load as checkpoint
from fivefold.checkpoint import manifest as checkpoint_manifest
from fivefold.train.trainer import train

ERRORS = {  # errno -> the words of the sentence and its fix
    errno.ENOSPC: "the disk is full; free space on that disk or set checkpoint.dir to another folder",
    errno.EIO: "the storage reported an input/output error; check the disk or network file system (dmesg, "
               "the storage's health), then retry or set checkpoint.dir to another folder",
    errno.EACCES: "permission denied; give this user access to it or set checkpoint.dir to another folder",
}


def _fail_second_save(monkeypatch, target, name, code):
    """`target.name` raises OSError `code` while the checkpoint of step 2 is being written."""
    original = getattr(target, name)

    def failing(*args, **kwargs):
        if any("step_00000002" in str(a) for a in (*args, *kwargs.values())) or failing.armed:
            raise OSError(code, "injected")
        return original(*args, **kwargs)

    failing.armed = False
    monkeypatch.setattr(target, name, failing)
    return failing


def _assert_nothing_lost(root):
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]  # no .tmp-, no step 2
    assert (root / "latest").read_text().strip() == "step_00000001"
    cfg = tiny_config({"checkpoint": {"dir": str(root), "resume": "auto"}})
    assert checkpoint.resolve(cfg) == root / "step_00000001"
    assert checkpoint_manifest.problem(root / "step_00000001") is None  # whole, every checksum


@pytest.mark.parametrize("code", list(ERRORS), ids=[errno.errorcode[c] for c in ERRORS])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_tensor_write_refused_by_the_storage(tmp_path, monkeypatch, code, async_save):
    failing = _fail_second_save(monkeypatch, dcp_files, "_write_item", code)
    original_save = checkpoint.save

    def arm_on_step_two(cfg, step, *args):  # DCP's writer sees only the temporary folder's files
        checkpoint.wait_for_save()  # an asynchronous step 1 is written unharmed first
        failing.armed = step == 2
        return original_save(cfg, step, *args)

    monkeypatch.setattr(checkpoint, "save", arm_on_step_two)
    with pytest.raises(FileProblem) as err:
        train(tiny_config({"train": {"steps": 3},
                           "checkpoint": {"dir": str(tmp_path), "every": 1, "async_save": async_save}}))
    assert str(err.value) == (f"cannot write checkpoint {tmp_path / 'step_00000002'}: {ERRORS[code]}; "
                              f"the previous checkpoint {tmp_path / 'step_00000001'} is intact")
    _assert_nothing_lost(tmp_path)


def test_manifest_write_refused_by_the_storage(tmp_path, monkeypatch):
    _fail_second_save(monkeypatch, checkpoint_manifest, "write", errno.ENOSPC)
    with pytest.raises(FileProblem) as err:
        train(tiny_config({"train": {"steps": 3}, "checkpoint": {"dir": str(tmp_path), "every": 1}}))
    assert str(err.value) == (f"cannot write checkpoint {tmp_path / 'step_00000002'}: {ERRORS[errno.ENOSPC]}; "
                              f"the previous checkpoint {tmp_path / 'step_00000001'} is intact")
    _assert_nothing_lost(tmp_path)


@pytest.mark.parametrize("optimizer, holds", [
    ("adamw", "fp32 weights and AdamW's two moments, 12 bytes per parameter"),
    ("muon", "fp32 weights and Muon's momentum of its matrices and AdamW's two moments of the rest, 8.74 bytes per "
             "parameter"),
])
def test_a_disk_without_room_for_one_checkpoint_is_said_before_the_first_step(tmp_path, monkeypatch, capsys,
                                                                              optimizer, holds):
    from collections import namedtuple

    from fivefold.checkpoint import space as checkpoint_space

    cfg = tiny_config({"train": {"steps": 1, "optimizer": optimizer},
                       "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 1}})
    needed = checkpoint_space.checkpoint_bytes(cfg)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint_space.shutil, "disk_usage", lambda path: usage(0, 0, needed - 1))
    train(cfg)
    warning = (f"warning: checkpoint folder {tmp_path / 'ckpt'} has {(needed - 1) / 1e9:.2f} GB free on its disk, "
               f"but one checkpoint of this model takes about {needed / 1e9:.2f} GB ({holds}); the first save will "
               "fail there: free space or set checkpoint.dir to a larger disk")
    assert capsys.readouterr().err.splitlines().count(warning) == 1
    # The estimate is the checkpoint's real size under either optimizer: its tensor files hold the
    # parameters and their state, plus DCP's header of ~1.6 kB per tensor, 9% of this tiny model's
    # AdamW checkpoint (measured), nothing at 1B+.
    written = sum(p.stat().st_size for p in (tmp_path / "ckpt" / "step_00000001").glob("*.distcp"))
    assert needed <= written < 1.15 * needed, (needed, written)
    monkeypatch.setattr(checkpoint_space.shutil, "disk_usage", lambda path: usage(0, 0, needed))
    assert checkpoint_space.space_warning(cfg, tmp_path / "ckpt") is None
