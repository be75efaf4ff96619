"""A checkpoint that proves it is whole: manifest.json lists every file with its size and CRC-32.

A node that died mid-copy, a full disk or a flipped bit leaves a folder that looks like a
checkpoint. At save, each rank checksums the DCP files it wrote (they are still in the page cache)
and rank 0 gathers them, adds its own small files, and writes the manifest last, before the
rename that makes the checkpoint visible. At load every rank checks every file's size and
checksums its share of the files (file i on rank i mod world), so verifying a checkpoint costs
one read of it spread over the ranks; the ranks then agree on the first problem found, so all
of them skip (or refuse) the same checkpoint. A checkpoint whose state.json carries no
`"manifest": true` (written by a version without manifests) loads unverified.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import torch.distributed as dist

from fivefold.config.confined import outside

MANIFEST = "manifest.json"
SMALL_FILES = (".metadata", "state.json", "config.toml")  # written by rank 0
_CHUNK = 8 << 20


def digest(path: Path) -> list[int]:
    """[size in bytes, CRC-32] of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return [size, crc]


def own_files(folder: Path, rank: int) -> dict[str, list[int]]:
    """The DCP data files this rank wrote (DCP names them `__<rank>_<n>.distcp`)."""
    return {p.name: digest(p) for p in sorted(folder.glob(f"__{rank}_*.distcp"))}


def gather_files(folder: Path, group) -> dict[str, list[int]]:
    """Every rank's data files with their digests (collective over `group`; the world when None)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = own_files(folder, rank)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return mine
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return {name: d for files in everyone for name, d in files.items()}


def write(folder: Path, data_files: dict[str, list[int]]) -> None:
    """Rank 0, after every rank's files and its own small files are in place."""
    files = {**data_files, **{name: digest(folder / name) for name in SMALL_FILES if (folder / name).is_file()}}
    path = folder / MANIFEST
    with open(path, "w") as f:
        json.dump({"files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def problem(folder: Path, share: tuple[int, int] = (0, 1), checksums: bool = True) -> str | None:
    """What is wrong with the checkpoint in `folder`, as a clause naming the file, or None.
    Sizes of all files, checksums of the files in this rank's `share` (index, count)."""
    try:
        recorded = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"{MANIFEST} is missing (the save did not finish)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST} is unreadable ({err})"
    if not isinstance(recorded, dict):
        return f"{MANIFEST} is unreadable (its files are not a table of names)"
    names = sorted(recorded)
    for name in names:
        why = outside(folder, name)
        if why is not None:  # a crafted manifest: never stat or checksum a file outside the checkpoint
            return f"{MANIFEST} names '{name}', which {why} (a checkpoint names only files inside its folder)"
        if not (isinstance(recorded[name], list) and len(recorded[name]) == 2):
            return f"{MANIFEST} lists '{name}' without its [size, CRC-32]"
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != recorded[name][0]:
            return f"{name} is {size} bytes but {recorded[name][0]} were written (truncated or still being copied)"
    index, count = share
    # Without `checksums` (checkpoint.verify = "sizes") only the small files rank 0 wrote are read.
    for name in names[index::count] if checksums else [n for n in names if n in SMALL_FILES]:
        if digest(folder / name) != recorded[name]:
            return f"{name} does not match its checksum (the file was altered or damaged)"
    return None


def verify(folder: Path, checksums: bool = True) -> str | None:
    """The first problem any rank finds in `folder`, the same on every rank (collective when a
    process group exists: every rank must call it with the same folder)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return problem(folder, checksums=checksums)
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem(folder, (dist.get_rank(), dist.get_world_size()), checksums))
    return next((p for p in found if p), None)
