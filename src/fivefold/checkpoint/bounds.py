"""DCP's metadata of a checkpoint checked against the folder before anything is read or allocated.

The `.metadata` pickle (read through an allow-list: checkpoint/sharded_io.py) says where every stored
piece lies: a file name, an offset and a length, plus each tensor's whole shape. DCP opens the
file it names relative to the checkpoint, and the loader allocates each tensor at the shape it is
given. A crafted metadata could therefore send a load to a file outside the checkpoint, or to bytes
past a file's end, or make a reader allocate terabytes for a tensor no file holds. Each is one
sentence here instead.
"""

from __future__ import annotations

import math
from pathlib import Path

from fivefold.config import ConfigError
from fivefold.config.confined import outside


def check_metadata(folder: Path, metadata) -> None:
    """Every storage entry names a file inside `folder` and bytes inside that file, and the tensors
    declared cannot hold more bytes than the data files do."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    where = folder / ".metadata"
    sizes: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        name = getattr(info, "relative_path", None)
        why = outside(folder, name) if isinstance(name, str) else "is not a file name"
        if why is not None:
            raise ConfigError(f"checkpoint file {where} places {getattr(index, 'fqn', '?')} in '{name}', which {why}: "
                              "a checkpoint may only name files inside its own folder; this checkpoint was altered "
                              "or crafted, so use one from a source you trust")
        if name not in sizes:
            path = folder / name
            sizes[name] = path.stat().st_size if path.is_file() else -1
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        fits = (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0
                and (sizes[name] < 0 or offset + length <= sizes[name]))  # a missing file is said at load
        if not fits:
            raise ConfigError(f"checkpoint {folder} could not be read: a data file is corrupt, truncated or missing "
                              f"({where.name} places {getattr(index, 'fqn', '?')} at bytes {offset}+{length} of {name}, "
                              f"which holds {sizes[name]} bytes); resume from an earlier checkpoint")
    data_bytes = sum(s for s in sizes.values() if s > 0)
    declared = 0
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        shape = tuple(item.size)
        if any(not isinstance(n, int) or n < 0 for n in shape):
            raise ConfigError(f"checkpoint file {where} gives {fqn} the shape {list(shape)}: the checkpoint is "
                              "damaged or crafted; resume from another checkpoint")
        dtype = getattr(getattr(item, "properties", None), "dtype", None)
        declared += math.prod(shape) * getattr(dtype, "itemsize", 1)  # each element is stored once
    if declared > data_bytes:
        raise ConfigError(f"checkpoint file {where} declares tensors of at least {declared:,} bytes, but its data "
                          f"files hold {data_bytes:,}: the checkpoint is damaged or crafted, and nothing was "
                          "allocated for it; resume from another checkpoint")
