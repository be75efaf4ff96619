"""A checkpoint, a prepared data folder and a Hugging Face folder are untrusted input (issue 52):
every path their files name (`latest`, manifest.json, DCP's .metadata, a prepared manifest's
shards, model.safetensors.index.json) must stay inside their own folder, and DCP's metadata must
not describe more bytes than its files hold. Each crafted input below is refused by the real
command in one sentence, and the files outside the run that it points at are neither read nor
written (tests/outside_the_run.py watches their access times)."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
from outside_the_run import Untouched, fivefold, refused, succeeded, train

from fivefold.checkpoint import manifest as checkpoint_manifest
from fivefold.checkpoint.sharded_io import _MetadataUnpickler

STEP = "step_00000002"
TRUST = "use one from a source you trust"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-step run's checkpoints and its Hugging Face export, made once."""
    base = tmp_path_factory.mktemp("saved")
    succeeded(train("--train.steps", "2", "--checkpoint.every", "1", "--log.dir", base / "run"))
    succeeded(fivefold("convert", base / "run" / "checkpoints", base / "hf"))
    return base


@pytest.fixture
def layout(saved, tmp_path):
    """tmp/run/checkpoints (the run's) and tmp/outside (a copy the crafted files point at)."""
    shutil.copytree(saved / "run" / "checkpoints", tmp_path / "run" / "checkpoints")
    shutil.copytree(saved / "run" / "checkpoints" / STEP, tmp_path / "outside" / STEP)
    return tmp_path / "run", tmp_path / "outside"


def _resume(run, resume):
    return train("--train.steps", "3", "--checkpoint.every", "1", "--log.dir", run, "--checkpoint.resume", resume,
                 "--checkpoint.verify", "full")  # full: a whole read of every file the manifest names


def _rewrite_metadata(step, change):
    with open(step / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    change(metadata)
    with open(step / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    manifest = json.loads((step / "manifest.json").read_text())  # its checksum agrees: only the path is wrong
    manifest["files"][".metadata"] = checkpoint_manifest.digest(step / ".metadata")
    (step / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("how", ["dots", "absolute"])
def test_latest_naming_a_folder_outside_the_root_is_refused(layout, how):
    run, outside = layout
    name = f"../../outside/{STEP}" if how == "dots" else str(outside / STEP)
    (run / "checkpoints" / "latest").write_text(name + "\n")
    watch = Untouched(outside)
    why = "climbs out with '..'" if how == "dots" else "is an absolute path"
    assert refused(_resume(run, "auto")) == (
        f"{run / 'checkpoints' / 'latest'} names '{name}', which {why}: a file may only name files inside its own "
        f"folder {run / 'checkpoints'}; this folder was altered or crafted, so {TRUST} (or restore it from a copy)")
    watch.check()


def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(layout):
    run, outside = layout
    step = run / "checkpoints" / STEP
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"]["../../../outside/" + STEP + "/__0_0.distcp"] = manifest["files"]["__0_0.distcp"]
    (step / "manifest.json").write_text(json.dumps(manifest))
    watch = Untouched(outside)
    said = refused(_resume(run, step))
    assert said.startswith(f"checkpoint {step} is damaged: manifest.json names '../../../outside/{STEP}/__0_0.distcp', "
                           "which climbs out with '..' (a checkpoint names only files inside its folder); "), said
    watch.check()


def test_a_data_file_that_is_a_symlink_out_of_the_checkpoint_is_refused(layout):
    run, outside = layout
    step = run / "checkpoints" / STEP
    (step / "__0_0.distcp").unlink()
    os.symlink(outside / STEP / "__0_0.distcp", step / "__0_0.distcp")  # same size and checksum as recorded
    watch = Untouched(outside)
    said = refused(_resume(run, step))
    assert said.startswith(f"checkpoint {step} is damaged: manifest.json names '__0_0.distcp', which is a symlink "
                           "that leads out of the folder"), said
    watch.check()


def test_a_step_folder_that_is_a_symlink_out_of_the_root_is_not_one_of_its_checkpoints(layout):
    run, outside = layout
    os.symlink(outside / STEP, run / "checkpoints" / "step_00000009")  # newer than any, and whole
    watch = Untouched(outside)
    done = succeeded(_resume(run, "auto"))
    assert f"saved step 3 to {run / 'checkpoints' / 'step_00000003'}" in done.stdout  # continued from its own step 2
    watch.check()


def test_dcp_metadata_placing_tensors_in_a_file_outside_is_refused(layout):
    run, outside = layout
    step = run / "checkpoints" / STEP
    target = str(outside / STEP / "__0_0.distcp")

    def elsewhere(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = target

    _rewrite_metadata(step, elsewhere)
    watch = Untouched(outside)
    said = refused(_resume(run, step))
    assert f"checkpoint file {step / '.metadata'} places " in said and (
        f" in '{target}', which is an absolute path: a checkpoint may only name files inside its own folder; this "
        f"checkpoint was altered or crafted, so {TRUST}") in said, said
    watch.check()


def test_dcp_metadata_declaring_more_bytes_than_its_files_hold_allocates_nothing(layout):
    run, outside = layout
    step = run / "checkpoints" / STEP

    def enormous(metadata):
        name = next(k for k in metadata.state_dict_metadata if k.startswith("model/"))
        metadata.state_dict_metadata[name].size = type(metadata.state_dict_metadata[name].size)([1 << 40, 1 << 20])

    _rewrite_metadata(step, enormous)
    said = refused(fivefold("generate", step, "--prompt", "ab", "--tokens", "1"))
    assert said.startswith(f"checkpoint file {step / '.metadata'} declares tensors of at least "), said
    assert said.endswith("the checkpoint is damaged or crafted, and nothing was allocated for it; resume from "
                         "another checkpoint"), said


def test_a_hugging_face_index_naming_a_file_outside_is_refused(saved, tmp_path):
    hf, outside = tmp_path / "hf", tmp_path / "outside"
    shutil.copytree(saved / "hf", hf)
    outside.mkdir()
    shutil.move(hf / "model.safetensors", outside / "model.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "../outside/model.safetensors"}}))
    watch = Untouched(outside)
    said = refused(fivefold("generate", hf, "--prompt", "ab", "--tokens", "1"))
    assert said.startswith(f"{hf / 'model.safetensors.index.json'} names '../outside/model.safetensors', which "
                           "climbs out with '..'"), said
    watch.check()


def test_a_prepared_manifest_naming_a_shard_outside_is_refused(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("hello world, " * 400)
    data, outside = tmp_path / "data", tmp_path / "outside"
    succeeded(fivefold("prepare", text, "--out", data))
    outside.mkdir()
    manifest = json.loads((data / "manifest.json").read_text())
    shutil.copy(data / manifest["shards"][0]["file"], outside / "shard.bin")
    manifest["shards"][0]["file"] = "../outside/shard.bin"
    (data / "manifest.json").write_text(json.dumps(manifest))
    watch = Untouched(outside)
    said = refused(train("--train.steps", "1", "--data.source", data, "--log.dir", tmp_path / "run"))
    assert said.startswith(f"{data / 'manifest.json'} names '../outside/shard.bin', which climbs out with '..'"), said
    watch.check()
    assert not (tmp_path / "run").exists()  # refused before the run made its folder
