"""`fivefold convert SRC DST`: fivefold checkpoints to and from Hugging Face folders, streamed.

- A fivefold checkpoint (a step_N folder, or a checkpoint root with `latest`), written by any
  layout, becomes a Hugging Face folder that transformers loads (config.json and safetensors shards
  with an index, as transformers writes them), one tensor in memory at a time: DCP loads each tensor
  alone into a tensor allocated for it, and the shard files are written as the tensors arrive.
- A Hugging Face folder becomes a weights-only fivefold checkpoint: the model's tensors (fp32, in
  torch.distributed.checkpoint files), state.json marked weights_only, and config.toml with the
  model's [model] section; each box is read from the safetensors files when DCP writes it. Training
  from it: `fivefold train DST/config.toml --checkpoint.resume DST` (a fresh optimizer, data and
  schedule from step 0, the imported weights).
Checkpoints store every tensor under its single-device name and whole shape, whichever layout
wrote them, so one process reads (or writes) them here, with no process group. Peak memory is
about the largest tensor (twice it when DCP reads a tensor stored whole), not the model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fivefold.config import Config, ConfigError, to_toml
from fivefold.config.file_errors import need_folder, need_output_folder, os_problem, verb
from fivefold.models.hf.interop import DEFAULT_SHARD_BYTES, model_from_tensors
from fivefold.models.hf.stream import HFBoxes, dequantised_note
from fivefold.checkpoint import manifest as checkpoint_manifest
from fivefold.checkpoint import sharded_io
from fivefold.checkpoint.save_load import FORMAT, read_state, read_tensors
from fivefold.train.export import checkpoint_folder, checkpoint_to_hf, model_config, run_tokenizer, with_tokenizer
from fivefold.train.lora_export import ADAPTER_CONFIG, adapted_model, lora_of, with_base, write_merged_folder
from fivefold.checkpoint.save_failures import storage_error

BLOCK_BYTES = 256 * 2**20  # the largest box an import writes (and a later reader of a slice loads)


def checkpoint_to_model(path, base: str = "") -> torch.nn.Module:
    """The single-device model with the weights of a fivefold checkpoint (any saving layout), read
    into fresh tensors: the peak is the model plus one stored piece. `base`: a LoRA checkpoint's
    base folder, where it is not where the run read it."""
    path = checkpoint_folder(path)
    state = with_base(path, read_state(path), base)
    cfg = model_config(state, path)
    if lora_of(state) is not None:  # adapters only: the base is read from where the run read it
        return adapted_model(path, state, cfg)
    return model_from_tensors(cfg, read_tensors(path, cfg))


def _boxes(shape: tuple, stacked: bool, block_bytes: int):
    """(offsets, sizes) covering a whole tensor: one expert at a time, at most block_bytes of fp32
    rows each (so that a reader of any slice, later, loads pieces of that size, not the tensor)."""
    head = 1 if stacked else 0  # stacked experts: (experts, out, in)
    row_bytes = math.prod(shape[head + 1:]) * 4
    step = max(1, block_bytes // row_bytes)
    tail = (0,) * (len(shape) - head - 1)
    for expert in range(shape[0]) if stacked else [None]:
        lead = () if expert is None else (expert,)
        for row in range(0, shape[head], step):
            yield (*lead, row, *tail), (*(1,) * head, min(step, shape[head] - row), *shape[head + 1:])


class _OnDemand(sharded_io.Pieces):
    """A tensor's boxes as shapes only (meta tensors) until DCP asks for one's data (`find`)."""

    def __init__(self, reader: HFBoxes, name: str, shape: tuple, block_bytes: int):
        super().__init__(torch.Size(shape), torch.float32)
        self.reader, self.name = reader, name
        for offsets, sizes in _boxes(shape, reader.adapter.is_stacked(name), block_bytes):
            self.add(offsets, torch.empty(sizes, device="meta"))

    def find(self, index) -> torch.Tensor:
        box = self.reader(self.name, self.shape, index.offset, super().find(index).shape)
        self.reader.close()  # unmap: the pages just read would otherwise stay in this process's RSS
        return box


def hf_to_checkpoint(src, dst, block_bytes: int = BLOCK_BYTES, reader: HFBoxes | None = None) -> Path:
    """A weights-only fivefold checkpoint from a Hugging Face folder, one box in memory at a time.

    One DCP save writes every box into a data file of its own: DCP keeps each tensor of a data file
    referenced until that file is closed (FileSystemWriter's per-file dict), so the usual one file
    per rank would end up holding the whole model.
    """
    reader = reader or HFBoxes(src)  # fp32: the trainer's master precision
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    state = {f"model/{name}": _OnDemand(reader, name, shape, block_bytes) for name, shape in reader.shapes.items()}
    sharded_io.quiet(dcp.save, state, storage_writer=dcp.FileSystemWriter(
        str(dst), single_file_per_rank=False, thread_count=1),
        planner=sharded_io._SavePlanner(flatten_state_dict=False), single_process=True)
    cfg = Config(model=reader.cfg)
    (dst / "state.json").write_text(json.dumps({"format": FORMAT, "step": 0, "weights_only": True,
                                                "manifest": True, "model": cfg.to_dict()["model"]}, indent=1))
    (dst / "config.toml").write_text(to_toml(cfg))
    checkpoint_manifest.write(dst, checkpoint_manifest.own_files(dst, 0))  # resume verifies it like a saved one
    return dst


def _checked_paths(src, dst) -> tuple[Path, Path]:
    """SRC a folder; DST a folder to create, or one this command (or a run) wrote before."""
    src = need_folder(src, "convert SRC", "give a Hugging Face folder or a fivefold checkpoint folder")
    ours = (lambda p: (p / "config.json").is_file() or (p / ADAPTER_CONFIG).is_file()) \
        if (src / "state.json").is_file() or (src / "latest").is_file() \
        else (lambda p: (p / "state.json").is_file())
    dst = need_output_folder(dst, "convert DST", "give a new folder to write", ours)
    return src, dst


def convert(src, dst, max_shard_bytes: int = DEFAULT_SHARD_BYTES, merge: bool = False, base: str = "") -> str:
    """Direction from what SRC is; returns a one-line summary. A LoRA checkpoint becomes a PEFT
    adapter folder, or with `merge` a Hugging Face folder of the merged weights; `base` is its base
    folder where that moved."""
    src, dst = _checked_paths(src, dst)
    if merge:
        return _merge(src, dst, max_shard_bytes, base)
    if (src / "config.json").is_file():
        if base:
            raise ConfigError(f"--base names the base of a LoRA checkpoint, and {src} is a Hugging Face folder; "
                              "drop --base")
        reader = HFBoxes(src)
        try:
            hf_to_checkpoint(src, dst, reader=reader)
        except (OSError, CheckpointException) as err:  # DCP wraps the storage's error in the latter
            cause = storage_error(err)
            if cause is None:
                raise
            raise os_problem(dst, cause, verb(cause, dst), "or choose another DST") from None
        note = dequantised_note(reader)
        return f"wrote fivefold checkpoint {dst} (train from it: fivefold train {dst}/config.toml " \
               f"--checkpoint.resume {dst})" + (f"; {note}" if note else "")
    if (src / "state.json").is_file() or (src / "latest").is_file():
        tokenizer = run_tokenizer(checkpoint_folder(src))  # its files go beside the weights when they exist
        checkpoint_to_hf(src, dst, max_shard_bytes, tokenizer, base)
        if (dst / ADAPTER_CONFIG).is_file():
            return f"wrote PEFT adapter folder {dst} (fivefold convert --merge {src} DIR writes the merged model)"
        return f"wrote Hugging Face folder {dst}"
    raise ConfigError(f"{src} is neither a Hugging Face folder (config.json) nor a fivefold checkpoint "
                      "(state.json or latest)")


def _merge(src: Path, dst: Path, max_shard_bytes: int, base: str = "") -> str:
    """`convert --merge`: a LoRA checkpoint's adapters merged into its base, as a Hugging Face folder."""
    if not ((src / "state.json").is_file() or (src / "latest").is_file()):
        raise ConfigError(f"--merge merges the adapters of a LoRA checkpoint, and {src} is not a fivefold "
                          "checkpoint (no state.json or latest); give the checkpoint of a run with lora.rank > 0")
    path = checkpoint_folder(src)
    state = read_state(path)
    if lora_of(state) is None:
        raise ConfigError(f"--merge merges LoRA adapters, and checkpoint {path} holds a whole model (lora.rank "
                          "was 0); drop --merge to write it as a Hugging Face folder")
    state = with_base(path, state, base)
    cfg = model_config(state, path)
    with_tokenizer(path, dst, run_tokenizer(path), lambda: write_merged_folder(path, state, cfg, dst, max_shard_bytes))
    return f"wrote Hugging Face folder {dst}: the base with the LoRA adapters of {path} merged into it"
