"""Hugging Face weights without holding the model: read any box of any tensor straight from the
safetensors files, and write a sharded folder one tensor at a time.

Reading (`HFBoxes`): the config, the expected shapes (from a meta-device model) and every file's
header are checked when the reader is made; afterwards a call reads only the box it is asked for,
with `safe_open(...).get_slice(name)[box]`. safetensors 0.8 answers with a view into its memory map
of the file, so nothing is read until the box is copied out, and the pages a copy reads count in
this process's RSS until the file is unmapped: whoever walks a whole model (load_pretrained,
convert) calls `close()` after each tensor (re-opening costs a header parse), while a training rank,
reading only its boxes, keeps the handles open.

A folder whose config.json says `quantization_config.quant_method = "mxfp4"` (gpt-oss's released
weights) may store a weight as a `_blocks`/`_scales` pair: it reads as the dequantised tensor,
only the groups of the box asked for (models/hf/mxfp4.py); `dequantised` names those weights.

Writing (`write_hf_folder`): the shard plan and every file's header follow from shapes and dtypes
alone, so each file is written header first and then tensor by tensor (safetensors' own save_file
needs a whole shard in memory). The folder is what transformers' save_pretrained writes:
`model.safetensors`, or `model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from fivefold.config import ConfigError, ModelConfig
from fivefold.config.confined import inside
from fivefold.config.file_errors import guarded
from fivefold.models import build_meta_model
from fivefold.models.hf.interop import DEFAULT_SHARD_BYTES, config_from_hf, hf_config_from
from fivefold.models.hf.adapter import IGNORED_HF
from fivefold.models.hf.mxfp4 import MXFP4Slice, quantised_pairs
from fivefold.models.registry import model_spec

INDEX = "model.safetensors.index.json"
REDO = "download or convert the Hugging Face folder again"  # the fix of a damaged file in one
PARTS = "parts"  # an entry of write_hf_folder whose Hugging Face tensor is made of several of ours
_SHARD_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors$")
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def read_hf_config(folder: Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face folder's config.json, or one sentence saying what is wrong."""
    return _model_config(folder, read_config_json(folder))


def _model_config(folder: Path, hf_cfg: dict) -> ModelConfig:
    try:
        return config_from_hf(hf_cfg)
    except ConfigError as err:
        raise ConfigError(f"{folder}/{err}") from None


def read_config_json(folder: Path) -> dict:
    """A Hugging Face folder's config.json, parsed, or one sentence saying what is wrong."""
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder; pass a Hugging Face checkpoint folder "
                          "(config.json + *.safetensors)")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder} has no config.json; load_pretrained reads Hugging Face checkpoint "
                          "folders (config.json + *.safetensors), and fivefold checkpoints cannot be "
                          "loaded this way yet")
    try:
        with guarded(folder / "config.json", "read", REDO):
            text = (folder / "config.json").read_text()
        hf_cfg = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{folder / 'config.json'} is not valid JSON ({err}); {REDO}") from None
    if not isinstance(hf_cfg, dict):
        raise ConfigError(f"{folder / 'config.json'} must hold a JSON object of model settings")
    return hf_cfg


class HFBoxes:
    """`reader(name, whole_shape, offsets, sizes)`: elements [offsets[i], offsets[i] + sizes[i]) of
    fivefold's whole tensor `name`, read from a Hugging Face folder and converted to `dtype` (None
    keeps the stored one). `shapes` lists what a fivefold checkpoint of the model holds (a tied
    copy is not in it, but reading it gives its source). `dequantised`: the Hugging Face weights
    stored in MXFP4, which read dequantised."""

    def __init__(self, folder, dtype: torch.dtype | None = torch.float32):
        self.folder, self.dtype = Path(folder), dtype
        self._handles: dict[Path, object] = {}
        hf_cfg = read_config_json(self.folder)
        self.cfg = _model_config(self.folder, hf_cfg)
        self._where = self._locate()
        # weight -> its stored (name, file) pairs: blocks, scales
        self._mxfp4 = self._quantised(hf_cfg.get("quantization_config"))
        self.dequantised = sorted(self._mxfp4)
        self.cfg = model_spec(self.cfg).hf.fit_to_files(self.cfg, set(self._where))
        spec = model_spec(self.cfg)
        self.adapter, self.tied = spec.hf, spec.tied(self.cfg)
        self.shapes = {name: tuple(t.shape) for name, t in build_meta_model(self.cfg).state_dict().items()
                       if name not in self.tied}  # HF omits a tied lm_head
        self._sources = {name: self.adapter.hf_sources(name, self.cfg.moe.n_experts) for name in self.shapes
                         if not self.adapter.ours_only.match(name)}
        for copy, source in self.tied.items():  # the trainer asks for the tied matrix under both names
            self._sources[copy] = self._sources[source]
        self._check()

    def __call__(self, name: str, whole_shape, offsets, sizes) -> torch.Tensor:
        shape = self.shapes.get(self.tied.get(name, name))
        offsets, sizes = tuple(map(int, offsets)), tuple(map(int, sizes))
        inside = shape == tuple(whole_shape) and len(offsets) == len(sizes) == len(shape) and all(
            0 <= o and 0 <= s and o + s <= n for o, s, n in zip(offsets, sizes, shape))
        if not inside:
            raise ValueError(f"box at {list(offsets)} of size {list(sizes)} in {name} {list(whole_shape)} "
                             f"is not inside a tensor of {self.folder} (its shape: "
                             f"{list(shape) if shape else 'no such tensor'})")
        if self.adapter.ours_only.match(name) or 0 in sizes:  # bias balancing's state starts at zero
            return torch.zeros(sizes, dtype=self.dtype or torch.float32)
        part = self.adapter.part_of(self.tied.get(name, name))
        if part is not None:  # a strided part of one Hugging Face tensor (gpt-oss's experts)
            hf, which = part
            view = which.read(self._slice(hf), offsets, sizes)
            return torch.empty(sizes, dtype=self.dtype or view.dtype).copy_(view)
        box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        stacked = self.adapter.is_stacked(name)  # (experts, out, in): one Hugging Face tensor per expert in the box
        sources = self._sources[name][box[0]] if stacked else self._sources[name]
        out = None
        for i, hf in enumerate(sources):
            view = self._slice(hf)[box[1:] if stacked else box]
            if out is None:
                out = torch.empty(sizes, dtype=self.dtype or view.dtype)
            (out[i] if stacked else out).copy_(view)
        return out

    def whole(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        return self(name, shape, (0,) * len(shape), shape)

    def close(self) -> None:
        """Unmap the files (their pages leave this process's RSS); the next read opens them again."""
        self._handles.clear()

    def _open(self, file: Path):
        if file not in self._handles:
            with guarded(file, "read", REDO, "safetensors file", formats=(SafetensorError,)):
                self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file]

    def _slice(self, hf: str):
        """A safetensors slice of Hugging Face tensor `hf` (the dequantised view of an MXFP4 pair)."""
        if hf in self._mxfp4:
            (blocks, blocks_file), (scales, scales_file) = self._mxfp4[hf]
            return MXFP4Slice(hf, self._open(blocks_file).get_slice(blocks), self._open(scales_file).get_slice(scales),
                              self.dtype or torch.bfloat16)  # bf16 holds every MXFP4 value exactly
        return self._open(self._where[hf]).get_slice(hf)

    def _quantised(self, quantisation) -> dict[str, tuple[tuple[str, Path], tuple[str, Path]]]:
        """In an MXFP4 folder (config.json's `quantization_config`), each `_blocks`/`_scales` pair
        leaves `_where` for the weight it stores."""
        if not isinstance(quantisation, dict) or quantisation.get("quant_method") != "mxfp4":
            return {}  # the family's read_config refused any other quantisation already
        pairs = {}
        for weight, (blocks, scales) in quantised_pairs(self._where).items():
            pairs[weight] = ((blocks, self._where.pop(blocks)), (scales, self._where.pop(scales)))
            self._where[weight] = pairs[weight][0][1]
        return pairs

    def _locate(self) -> dict[str, Path]:
        """Hugging Face tensor name -> the file holding it (the index decides when there is one)."""
        index = self.folder / INDEX
        if index.is_file():
            with guarded(index, "read", REDO, f"index ({INDEX} with a weight_map)",
                         formats=(ValueError, KeyError, TypeError, AttributeError)):
                weight_map = json.loads(index.read_text())["weight_map"]
            # the index is untrusted like the rest of the folder: its files stay inside it
            return {name: inside(self.folder, file, index) for name, file in weight_map.items()}
        files = sorted(self.folder.glob("*.safetensors"))
        for file in files:  # a symlink leading out of the folder is not part of it
            inside(self.folder, file.name, f"Hugging Face folder {self.folder}")
        if not files:
            other = [p.name for p in self.folder.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
            hint = (f"; it has {', '.join(sorted(other))}, which fivefold does not read because pickle files "
                    "can run code: convert them to safetensors first") if other else ""
            raise ConfigError(f"{self.folder} has no *.safetensors weight files{hint}")
        return {name: file for file in files for name in self._open(file).keys()}

    def _check(self) -> None:
        folder = self.folder
        needed = {hf: ours for ours, names in self._sources.items() for hf in names}
        # A file may hold a tied copy too (transformers drops it, others keep it): never needed.
        tied_copies = {self.adapter.maybe_hf_name(copy) for copy in self.tied} | set(self.adapter.hf_copies(self.cfg))
        for name in self._where:
            dropped = IGNORED_HF.match(name) or self.adapter.dropped_by_hf(name, self.cfg)
            if name not in needed and not dropped and name not in tied_copies:
                raise ConfigError(f"{folder} holds tensor {name}, which fivefold's {self.cfg.family} has no "
                                  "place for; check that config.json describes these weights")
        held: dict[Path, set] = {}  # names in each file, for an index that places a tensor wrongly
        for hf, ours in needed.items():
            expected = self.shapes[self.tied.get(ours, ours)]
            part = self.adapter.part_of(ours)
            expected = list(part[1].hf_shape(expected) if part is not None else
                            expected[1:] if self.adapter.is_stacked(ours) else expected)
            if hf not in self._where:
                raise ConfigError(f"{folder} is missing tensor {hf} (shape {expected}) that config.json implies")
            for stored, file in self._mxfp4.get(hf, [(hf, self._where[hf])]):
                if not file.is_file():
                    raise ConfigError(f"{file} is named by {INDEX} but does not exist")
                if stored not in held.setdefault(file, set(self._open(file).keys())):
                    raise ConfigError(f"{file} does not hold tensor {stored}, which {INDEX} places there")
            try:
                shape = list(self._slice(hf).get_shape())
            except ConfigError as err:  # an MXFP4 pair of the wrong dtype or shapes
                raise ConfigError(f"{folder}: {err}") from None
            if shape != expected:
                raise ConfigError(f"tensor {hf} in {file} has shape {shape}, but config.json implies {expected}")


def dequantised_note(reader: HFBoxes) -> str:
    """One line naming the weights a reader dequantises ("" when none), layers and experts as *."""
    patterns = sorted({re.sub(r"\.\d+\.", ".*.", name) for name in reader.dequantised})
    return f"dequantised {len(reader.dequantised)} MXFP4 weights to {reader.dtype or torch.bfloat16}: " \
           f"{', '.join(patterns)}" if patterns else ""


def hf_box_reader(folder) -> tuple[ModelConfig, Callable[[str, tuple, tuple, tuple], torch.Tensor]]:
    """The model config of a Hugging Face folder and `fill(name, whole_shape, offsets, sizes)`, which
    reads that box of fivefold's tensor `name` as fp32 (an `HFBoxes`; `fill.close()` unmaps the files)."""
    reader = HFBoxes(folder)
    return reader.cfg, reader


# --------------------------------------------------------------------------------------------
# Writing


def _write_safetensors(file: Path, entries: list[tuple[str, tuple, torch.dtype, Callable]]) -> None:
    """One safetensors file from (name, shape, dtype, get) entries, each `get()` called once, in order."""
    header: dict = {"__metadata__": {"format": "pt"}}  # transformers refuses files without "format"
    offset = 0
    for name, shape, dtype, _ in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, dtype, get in entries:
            tensor = get().detach()
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:  # the header is written already
                raise ValueError(f"{name}: got {list(tensor.shape)} {tensor.dtype}, planned {list(shape)} {dtype}")
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())  # little-endian, as the format


def write_hf_folder(folder, cfg: ModelConfig, tensors: dict[str, tuple[tuple, torch.dtype]],
                    read: Callable[[str], torch.Tensor], max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """A Hugging Face folder for fivefold tensors `tensors` (name -> whole shape and dtype, in state-dict
    order), whose data `read(name)` returns, each once; holds one fivefold tensor at a time."""
    spec = model_spec(cfg)
    adapter, tied = spec.hf, spec.tied(cfg)
    hf_cfg = hf_config_from(cfg, next(iter(tensors.values()))[1])  # refuses what HF cannot express
    entries = []  # (hf name, shape, dtype, our name, expert or None, or PARTS for a tensor of parts)
    made_of_parts: set[str] = set()
    for name, (shape, dtype) in tensors.items():
        if adapter.ours_only.match(name) or name in tied:
            continue  # no Hugging Face counterpart (the family's hf_config_from refused bias balancing
            # unless its class holds the bias); HF re-ties lm_head
        part = adapter.part_of(name)
        if part is not None:  # one entry for the Hugging Face tensor, made when its first part comes
            if part[0] not in made_of_parts:
                made_of_parts.add(part[0])
                entries.append((part[0], part[1].hf_shape(shape), dtype, name, PARTS))
            continue
        stacked = adapter.is_stacked(name)
        for expert, hf in enumerate(adapter.hf_sources(name, cfg.moe.n_experts)):
            entries.append((hf, tuple(shape[1:] if stacked else shape), dtype, name, expert if stacked else None))
    for hf, name in adapter.hf_copies(cfg).items():  # tensors the family's files repeat
        source = tied.get(name, name)  # a tied output layer is the embedding
        entries.append((hf, tuple(tensors[source][0]), tensors[source][1], source, None))

    shards: list[list] = [[]]  # consecutive entries, a new shard when the next would pass the limit
    filled = 0
    for entry in entries:
        size = math.prod(entry[1]) * entry[2].itemsize
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(entry)
        filled += size
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in [*folder.glob("model*.safetensors"), folder / INDEX]:  # an earlier save's other layout
        if old.is_file() and old.name not in names and (old.name == INDEX or _SHARD_FILE.match(old.name)):
            old.unlink()
    (folder / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")

    held: dict[str, torch.Tensor] = {}  # the one fivefold tensor being written (experts span entries)

    def piece(name: str, expert) -> torch.Tensor:
        if expert is PARTS:  # a Hugging Face tensor made of several of ours, each read once
            held.clear()
            hf = adapter.hf_name(name)
            ours = adapter.parts_of(hf)
            out = torch.empty(ours[0][1].hf_shape(tensors[ours[0][0]][0]), dtype=tensors[name][1])
            for our_name, which in ours:
                which.write(out, read(our_name))
            return out
        if name not in held:
            held.clear()  # let the previous tensor go before reading the next
            held[name] = read(name)
        return held[name] if expert is None else held[name][expert]

    for file, shard in zip(names, shards):
        _write_safetensors(folder / file, [(hf, shape, dtype, lambda n=name, e=expert: piece(n, e))
                                           for hf, shape, dtype, name, expert in shard])
    held.clear()
    if len(shards) > 1:  # the index, as transformers writes it
        index = {"metadata": {"total_parameters": sum(math.prod(e[1]) for e in entries),
                              "total_size": sum(math.prod(e[1]) * e[2].itemsize for e in entries)},
                 "weight_map": {e[0]: file for file, shard in zip(names, shards) for e in shard}}
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return folder


def make_random_hf_llama(folder, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int,
                         dtype: torch.dtype = torch.bfloat16, tie_embeddings: bool = False,
                         max_shard_bytes: int = DEFAULT_SHARD_BYTES, seed: int = 0) -> Path:
    """A Hugging Face Llama folder with random weights (N(0, 0.02); norms 1), written tensor by tensor
    so that making a model of many GB needs the memory of its largest tensor (benchmarks, tests)."""
    cfg = ModelConfig(dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, ffn_dim=ffn,
                      vocab_size=vocab, tie_embeddings=tie_embeddings, max_seq_len=4096)
    shapes = {name: tuple(t.shape) for name, t in build_meta_model(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)

    def random(name: str) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shapes[name], dtype=dtype)
        return torch.empty(shapes[name], dtype=dtype).normal_(0.0, 0.02, generator=gen)  # no fp32 copy

    return write_hf_folder(folder, cfg, {name: (shape, dtype) for name, shape in shapes.items()}, random,
                           max_shard_bytes)
