"""The manifest of a prepared folder (`fivefold prepare`): its file name, its format tag and its
reader. Validation reads it before any process starts (the tokenizer, the document count);
data/prepare.py writes it and data/token_shards.py maps the shards it lists.
"""

from __future__ import annotations

import json
from pathlib import Path

from fivefold.config.errors import ConfigError
from fivefold.config.file_errors import guarded

MANIFEST = "manifest.json"
FORMAT = "fivefold-tokens"


def read_manifest(folder: str) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise ConfigError(f"'{folder}' is not a prepared folder (no {MANIFEST}); make one with "
                          f"`fivefold prepare SRC --out {folder}`")
    with guarded(path, "read", f"or prepare the folder again (`fivefold prepare SRC... --out {folder}`)"):
        text = path.read_text()  # a FileProblem is a ValueError too: the OS's errors are kept apart
    try:
        manifest = json.loads(text)
    except ValueError as err:
        raise ConfigError(f"{path} is not valid JSON ({err}); prepare the folder again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a fivefold token manifest; prepare the folder again")
    return manifest
