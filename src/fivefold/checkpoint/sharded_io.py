"""Per-rank sharded tensor files through torch.distributed.checkpoint (DCP), for any layout.

Every tensor is stored under its single-device name and whole shape; each rank declares the
rectangular boxes of it that it holds (`Pieces`), DCP writes each box once (replicas are
de-duplicated, the writing spread over ranks) into per-rank files, and its metadata records where
every box lies. On load each rank declares the boxes it needs, in its own layout, and DCP reads the
overlapping parts of whatever boxes were saved: resharding is DCP's overlap resolution, with no
conversion step and no whole tensor on any rank.

Why our own box list rather than DTensors: ZeRO-1/2 keep optimizer state in flat chunks whose
edges cut tensors mid-row, and expert-parallel tensors are local slices with an offset along the
expert dimension; neither is a DTensor placement. DCP's checkpointable protocol
(`__create_write_items__`, `__create_chunk_list__`) accepts any such box list; the planners below
look the boxes up by offset.

Safety: tensor data is read with torch.load(weights_only=True) by DCP; DCP's `.metadata` file is
a pickle, so it is read with an unpickler that admits only DCP's own metadata classes.
"""

from __future__ import annotations

import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from fivefold.config import ConfigError
from fivefold.checkpoint.bounds import check_metadata


@dataclass
class Pieces:
    """This rank's boxes of one whole tensor of shape `shape`: (offsets, local tensor) pairs.
    Saving reads the local tensors; loading writes into them (they may be views)."""

    shape: torch.Size
    dtype: torch.dtype
    boxes: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)

    def add(self, offsets, tensor: torch.Tensor) -> None:
        if tensor.numel():  # an empty shard (uneven split) holds nothing to read or write
            self.boxes.append((tuple(int(o) for o in offsets), tensor))

    def size(self) -> torch.Size:  # DCP compares it with the stored whole shape
        return torch.Size(self.shape)

    def chunk(self, offsets, tensor) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.shape)

    # --- DCP's checkpointable protocol ---
    def __create_write_items__(self, fqn: str, _obj) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self.chunk(offsets, t), properties=props,
                                                      size=self.size()))
                for offsets, t in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self.chunk(offsets, t) for offsets, t in self.boxes]

    def find(self, index: MetadataIndex) -> torch.Tensor:
        """The box DCP means: by position (two boxes may share offsets on load, e.g. the two
        copies of a tied embedding on one rank), else by offsets."""
        if index.index is not None and index.index < len(self.boxes):
            offsets, tensor = self.boxes[index.index]
            if torch.Size(offsets) == index.offset:
                return tensor
        for offsets, tensor in self.boxes:
            if torch.Size(offsets) == index.offset:
                return tensor
        raise KeyError(f"{index.fqn}: no box at {list(index.offset)}")


def whole(tensor: torch.Tensor) -> Pieces:
    """A tensor this rank holds entirely (one box at the origin)."""
    out = Pieces(tensor.shape, tensor.dtype)
    out.add((0,) * tensor.dim(), tensor)
    return out


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.find(index) if isinstance(obj, Pieces) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # The default set-up walks the dict and replaces objects it does not know with None.
        super().set_up_planner(dict(state_dict), metadata, is_coordinator)
        self.state_dict = state_dict

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.find(index) if isinstance(obj, Pieces) else super().lookup_tensor(index)


def quiet(call, *args, single_process: bool, **kwargs) -> None:
    # Without a process group DCP works in one process, as asked, but warns that it does.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        call(*args, no_dist=single_process, **kwargs)


def save(tensors: dict[str, Pieces], folder: Path, process_group=None, single_process: bool = False) -> None:
    """Collective over `process_group` (all ranks when None), unless `single_process`."""
    quiet(dcp.save, tensors, storage_writer=dcp.FileSystemWriter(str(folder), thread_count=1),
           planner=_SavePlanner(flatten_state_dict=False), process_group=process_group,
           single_process=single_process or not torch.distributed.is_initialized())


# What a DCP .metadata pickle may name: DCP's metadata classes and the torch/stdlib types inside.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch", "device"),
     ("torch.serialization", "_get_layout"),  # a layout by name, as torch's weights_only loader allows
     ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata is unpickled with only DCP's own classes allowed."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(str(self.path)) / ".metadata"
        if not path.is_file():
            raise ConfigError(f"checkpoint file {path} is missing; the checkpoint is partial")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except Exception as err:  # noqa: BLE001 - a damaged pickle raises many types
            raise ConfigError(f"checkpoint file {path} is corrupt or not a fivefold checkpoint ({err}); "
                              "resume from an earlier checkpoint") from None
        if not isinstance(metadata, Metadata):
            raise ConfigError(f"checkpoint file {path} does not hold checkpoint metadata")
        check_metadata(Path(str(self.path)), metadata)  # before DCP opens a file or anything is allocated
        metadata.storage_meta = metadata.storage_meta or dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _tensors(folder: Path) -> dict[str, TensorStorageMetadata]:
    meta = SafeReader(str(folder)).read_metadata()
    return {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Name -> whole shape of every tensor stored in a DCP folder (reads the metadata only)."""
    return {k: tuple(v.size) for k, v in _tensors(folder).items()}


def dtypes(folder: Path) -> dict[str, torch.dtype]:
    return {k: v.properties.dtype for k, v in _tensors(folder).items()}


def load(tensors: dict[str, Pieces], folder: Path, process_group=None, single_process: bool = False) -> None:
    """Fill every box of `tensors` from the checkpoint (collective like `save`). A damaged data
    file becomes one sentence naming the folder."""
    try:
        quiet(dcp.load, tensors, storage_reader=SafeReader(str(folder)),
               planner=_LoadPlanner(flatten_state_dict=False), process_group=process_group,
               single_process=single_process or not torch.distributed.is_initialized())
    except ConfigError:
        raise
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP gathers every rank's failure
        first = str(err).strip().splitlines()
        raise ConfigError(f"checkpoint {folder} could not be read: a data file is corrupt, truncated or "
                          f"missing ({first[-1][:200] if first else type(err).__name__}); resume from an "
                          "earlier checkpoint") from None
