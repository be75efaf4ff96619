"""A fivefold checkpoint as a Hugging Face folder, streamed: what `fivefold convert CKPT DST` and
`checkpoint.export_hf` (at the end of a run) write.

The folder is what transformers writes (config.json and safetensors shards with an index) plus the
run's tokenizer files (tokenizer.json and, beside it, tokenizer_config.json with its chat template),
so transformers, vLLM or `fivefold generate` read the result without the run's config. One tensor
is in memory at a time: DCP loads each tensor alone into a tensor allocated for it, and the shard
files are written as the tensors arrive.
"""

from __future__ import annotations

import dataclasses

import tomllib
from pathlib import Path

import torch

from fivefold.config import ConfigError
from fivefold.configure import load_config
from fivefold.config.file_errors import os_problem, verb
from fivefold.models.hf.interop import DEFAULT_SHARD_BYTES
from fivefold.models.hf.stream import write_hf_folder
from fivefold.checkpoint import sharded_io
from fivefold.data.chat_template import copy_tokenizer
from fivefold.checkpoint.save_load import LATEST, follow_latest, read_state
from fivefold.checkpoint.state_shapes import check_shapes, expected_tensors

PREPARED_TOKENIZER = "tokenizer"  # where `fivefold prepare --chat` keeps a copy of its tokenizer files


def model_config(state: dict, path: Path):
    """The checkpoint's model settings as recorded, every key resolved: the model.init_from folder
    is not read again (it may have moved; a LoRA checkpoint's base is checked where it is read)."""
    try:
        recorded = dict(state["model"])
        folder = recorded.pop("init_from", "")
        return dataclasses.replace(load_config(None, {"model": recorded}).model, init_from=folder)
    except (KeyError, TypeError, ConfigError) as err:
        raise ConfigError(f"checkpoint {path}/state.json has no usable [model] settings ({err})") from None


def checkpoint_folder(path) -> Path:
    path = Path(path)
    if (path / LATEST).is_file() and not (path / "state.json").is_file():
        path = follow_latest(path)
    if not (path / "state.json").is_file():
        raise ConfigError(f"{path} is not a fivefold checkpoint (no state.json)")
    return path


def data_tokenizer(tokenizer: str, source: str) -> str:
    """The tokenizer file of a run's data: data.tokenizer, or the copy a chat prepare keeps in its
    folder (a prepared folder's tokenizer is its own; data.tokenizer may be left at byte)."""
    kept = Path(source) / PREPARED_TOKENIZER / "tokenizer.json"
    return str(kept) if tokenizer == "byte" and kept.is_file() else tokenizer


def run_tokenizer(folder: Path) -> str:
    """The tokenizer the run trained with, from its config.toml's [data] (byte when absent)."""
    try:
        saved = tomllib.loads((folder / "config.toml").read_text()).get("data", {})
    except (OSError, tomllib.TOMLDecodeError):
        return "byte"  # config.toml is for people, not required: byte is the default tokenizer
    return data_tokenizer(saved.get("tokenizer", "byte"), saved.get("source", ""))


def checkpoint_to_hf(src, dst, max_shard_bytes: int = DEFAULT_SHARD_BYTES, tokenizer: str = "byte",
                     base: str = "") -> Path:
    """A Hugging Face folder from a fivefold checkpoint, one tensor in memory at a time; with a
    `tokenizer` file, its folder's tokenizer files are copied beside the weights. A LoRA checkpoint
    (adapters only) becomes a PEFT adapter folder instead (train/lora_export.py)."""
    path = checkpoint_folder(src)
    state = read_state(path)
    from fivefold.train.lora_export import lora_of, with_base, write_peft_folder

    state = with_base(path, state, base)
    cfg = model_config(state, path)

    if lora_of(state) is not None:
        return with_tokenizer(path, dst, tokenizer, lambda: write_peft_folder(path, state, cfg, dst))
    expected = expected_tensors(cfg, with_optimizer=False)  # in state-dict order, which the shards follow
    check_shapes(path, sharded_io.shapes(path), expected, "model")
    dtypes = sharded_io.dtypes(path)

    def read(name: str) -> torch.Tensor:  # DCP loads a subset of keys into tensors we allocate
        key = f"model/{name}"
        tensor = torch.empty(expected[key], dtype=dtypes[key])
        sharded_io.load({key: sharded_io.whole(tensor)}, path, single_process=True)
        return tensor

    try:
        out = write_hf_folder(dst, cfg, {key.removeprefix("model/"): (shape, dtypes[key])
                                         for key, shape in expected.items()}, read, max_shard_bytes)
        if tokenizer != "byte" and Path(tokenizer).is_file():
            copy_tokenizer(Path(tokenizer), Path(dst))
    except OSError as err:  # the checkpoint's own reads are one sentence already (sharded_io.load)
        raise os_problem(dst, err, verb(err, dst), "or choose another folder to export to; the checkpoint "
                         f"{path} is unchanged") from None
    return out




def with_tokenizer(path: Path, dst, tokenizer: str, write) -> Path:
    """`write()`'s folder with the run's tokenizer files beside it; a write failure in one sentence."""
    try:
        out = write()
        if tokenizer != "byte" and Path(tokenizer).is_file():
            copy_tokenizer(Path(tokenizer), Path(dst))
    except OSError as err:
        raise os_problem(dst, err, verb(err, dst), "or choose another folder to export to; the checkpoint "
                         f"{path} is unchanged") from None
    return out
