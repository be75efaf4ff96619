"""Paths named inside untrusted files stay inside the folder that holds them.

A checkpoint (its manifest, DCP's metadata, `latest`), a prepared data folder's manifest and a
Hugging Face index are files a user may have downloaded or been handed. Each names other files by
path, and fivefold reads whatever those paths lead to: a name like `../../etc/passwd`, an absolute
path or a symlink pointing out would make a load read (or a CRC check read whole) a file that is
not part of the folder. Every such name is resolved here first, symlinks followed, and refused in
one sentence unless it lands inside the folder.
"""

from __future__ import annotations

from pathlib import Path, PurePath

from fivefold.config.errors import ConfigError


def outside(folder, name) -> str | None:
    """Why `name` (as written in a file of `folder`) leads outside `folder`, or None when it stays in."""
    text = str(name)
    if not text or "\x00" in text:
        return "is empty or not a file name"
    pure = PurePath(text)
    if pure.is_absolute() or "\\" in text and PurePath(text.replace("\\", "/")).is_absolute():
        return "is an absolute path"
    if ".." in pure.parts:
        return "climbs out with '..'"
    base = Path(folder).resolve()
    if not (base / pure).resolve().is_relative_to(base):
        return "is a symlink that leads out of the folder"
    return None


def inside(folder, name, named_by) -> Path:
    """`folder / name` when it resolves inside `folder`; else one sentence naming the file that
    named it (`named_by`) and the fix."""
    why = outside(folder, name)
    if why is not None:
        raise ConfigError(f"{named_by} names '{name}', which {why}: a file may only name files inside its own "
                          f"folder {folder}; this folder was altered or crafted, so use one from a source you "
                          "trust (or restore it from a copy)")
    return Path(folder) / str(name)
