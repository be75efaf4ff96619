"""A Hugging Face tokenizer.json read through the file boundary (config/file_errors.py): the OS's
error on the file (EIO, EACCES, ...) and a file that is cut short or is not a tokenizer are each one
sentence naming the file, wherever it is read (validation, a rank's tokenizer, prepare, generate).

The bytes are read here and handed to `Tokenizer.from_buffer`, because that is the loader that
raises a ValueError for a bad file; `Tokenizer.from_file` raises a bare Exception for both the OS's
errors and bad files, which could only be caught with everything else.
"""

from __future__ import annotations

from pathlib import Path

from fivefold.config.file_errors import FileProblem, guarded

_PREFIX = "Cannot instantiate Tokenizer from buffer: "  # the library's wording around its reason


def tokenizer_bytes(path, role: str) -> bytes:
    """The file's bytes; `role` names where the path was given ("data.tokenizer", "--tokenizer")."""
    with guarded(path, "read tokenizer", f"or give {role} another copy of it"):
        return Path(path).read_bytes()


def parse_tokenizer(data: bytes, path, role: str):
    """A `tokenizers.Tokenizer` from the bytes of `path`; one sentence when they are not one."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_buffer(data)
    except ValueError as err:
        reason = " ".join(str(err).removeprefix(_PREFIX).split())
        raise FileProblem(f"{role} '{path}' is not a Hugging Face tokenizer.json ({reason}); give the "
                          "tokenizer.json of a model (its folder holds one) or 'byte'") from None


def read_tokenizer(path, role: str):
    return parse_tokenizer(tokenizer_bytes(path, role), path, role)
