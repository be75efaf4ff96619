"""Documents out of local files, streamed, with one sentence for bad input.

Formats: text files (.txt .md .py: a whole file is one document), JSON lines (.jsonl: one document
per non-blank line, its text in one field), parquet (.parquet: one document per row, read by row
group and batch) and Arrow files written by `datasets.save_to_disk` (.arrow, read batch by batch).
A bad line names its file and line: malformed JSON, a missing / null / non-string text field,
bytes that are not UTF-8. Nothing here reads a whole file into memory, except a text file that the
raw-file training path asks for as one document (small data by definition).

The prepare step cuts files into pieces (`Piece`): byte ranges ending at a line end for text and
jsonl, row-group ranges for parquet, whole files for Arrow streams; and groups consecutive small
pieces into units of about the unit size (one worker's job, one shard). Both depend only on the
files and the unit size, so the same inputs always give the same units, whatever the worker count.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from fivefold.config import ConfigError

TEXT_SUFFIXES = (".txt", ".md", ".py")
SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet", ".arrow")
KINDS = {**{s: "text" for s in TEXT_SUFFIXES}, ".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
BATCH_BYTES = 1 << 20  # text handed to the tokenizer at once: large enough to batch, small enough to bound memory
BATCH_ROWS = 1024


def _pyarrow(path: Path):
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401 - submodules used below
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ConfigError(f"reading {path} needs pyarrow; run `pip install pyarrow`") from None
    return pyarrow


# ---------------------------------------------------------------- which files


def _saved_dataset_files(folder: Path) -> list[Path] | None:
    """The Arrow files of a `datasets.save_to_disk` folder, in the dataset's own order."""
    state = folder / "state.json"
    if not state.is_file():
        return None
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError):
        return None
    return [folder / name for name in names]


def folder_files(folder: Path) -> list[Path]:
    saved = _saved_dataset_files(folder)
    if saved is not None:
        return saved
    return sorted(p for p in folder.rglob("*") if p.suffix in SUFFIXES and p.is_file())


def list_files(sources: list[str]) -> list[Path]:
    """Files, folders (recursively; a saved dataset by its state.json) and globs, in a stable order."""
    files: list[Path] = []
    for source in sources:
        if any(ch in source for ch in "*?["):
            matches = [Path(m) for m in sorted(glob.glob(source, recursive=True))]
            if not matches:
                raise ConfigError(f"'{source}' matches no file")
            for match in matches:
                files.extend(folder_files(match) if match.is_dir() else [match] if match.suffix in SUFFIXES else [])
            continue
        path = Path(source)
        if path.is_dir():
            found = folder_files(path)
            if not found:
                raise ConfigError(f"'{source}' holds no {'/'.join(SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise ConfigError(f"'{source}' is not a {'/'.join(SUFFIXES)} file")
            files.append(path)
        else:
            raise ConfigError(f"'{source}' does not exist")
    if not files:
        raise ConfigError(f"{' '.join(sources)} hold no {'/'.join(SUFFIXES)} files")
    return files


# ---------------------------------------------------------------- units


@dataclass(frozen=True)
class Piece:
    """A part of one file; a unit (one worker's job, one shard) is a run of consecutive pieces."""

    path: str
    kind: str  # text | jsonl | parquet | arrow
    start: int  # first byte (text, jsonl) or row group (parquet); 0 for arrow
    stop: int  # end byte or row group (exclusive); -1 for arrow (the whole stream)
    first_row: int = 0  # rows of the file before this piece (parquet), for error messages
    size: int = 0  # bytes it covers (parquet: the row groups' size), for grouping pieces into units

    def as_dict(self) -> dict:
        return asdict(self)


def _line_cuts(path: Path, size: int, unit_bytes: int) -> list[int]:
    """Offsets just after the first newline at or past each multiple of unit_bytes."""
    cuts = [0]
    with path.open("rb") as f:
        while cuts[-1] + unit_bytes < size:
            f.seek(cuts[-1] + unit_bytes)
            while True:  # a line may be longer than one read
                block = f.read(1 << 16)
                if not block:
                    return cuts
                newline = block.find(b"\n")
                if newline >= 0:
                    cut = f.tell() - len(block) + newline + 1
                    break
            if cut >= size:
                break
            cuts.append(cut)
    return cuts


def _pieces(path: Path, unit_bytes: int) -> list[Piece]:
    kind = KINDS[path.suffix]
    if kind in ("text", "jsonl"):
        size = path.stat().st_size
        cuts = _line_cuts(path, size, unit_bytes)
        return [Piece(str(path), kind, a, b, 0, b - a) for a, b in zip(cuts, cuts[1:] + [size])]
    if kind == "arrow":
        return [Piece(str(path), kind, 0, -1, 0, path.stat().st_size)]
    meta, pieces = _open_parquet(path).metadata, []
    first, rows_before, size, rows = 0, 0, 0, 0
    for group in range(meta.num_row_groups):  # consecutive row groups of about unit_bytes
        size += meta.row_group(group).total_byte_size
        rows += meta.row_group(group).num_rows
        if size >= unit_bytes or group == meta.num_row_groups - 1:
            pieces.append(Piece(str(path), kind, first, group + 1, rows_before, size))
            first, rows_before, size, rows = group + 1, rows_before + rows, 0, 0
    return pieces


def plan_units(files: list[Path], unit_bytes: int) -> list[list[dict]]:
    """Units of about unit_bytes: big files cut into pieces, small files' pieces grouped."""
    units: list[list[dict]] = []
    size = unit_bytes  # start a new unit with the first piece
    for path in files:
        for piece in _pieces(path, unit_bytes):
            if piece.size <= 0:  # an empty file holds no text (prepare refuses when all are empty)
                continue
            if size + piece.size > unit_bytes or not units:
                units.append([])
                size = 0
            units[-1].append(piece.as_dict())
            size += piece.size
    return units


# ---------------------------------------------------------------- reading


def _line_number(path: str, offset: int) -> int:
    """1-based number of the line holding byte `offset` (counted only when reporting an error)."""
    lines, done = 1, 0
    with open(path, "rb") as f:
        while done < offset:
            block = f.read(min(1 << 24, offset - done))
            if not block:
                break
            lines += block.count(b"\n")
            done += len(block)
    return lines


# The fields a conversation comes in (data/prepare_chat.py reads them with --chat).
CONVERSATION_FIELDS = ("messages", "prompt")


def _conversation_key(record: dict) -> str | None:
    return next((key for key in CONVERSATION_FIELDS if isinstance(record.get(key), (list, str))
                 and (key != "prompt" or "completion" in record)), None)


def _is_conversation(record: dict) -> bool:
    return _conversation_key(record) is not None


def _not_utf8(path: str, offset: int, err: UnicodeDecodeError) -> ConfigError:
    at = offset + err.start
    return ConfigError(f"{path}:{_line_number(path, at)} is not UTF-8 text (byte {at}); convert the file to "
                       "UTF-8 or leave it out")


def _not_text(value, where: str, field: str, hint: str) -> ConfigError:
    if value is None:
        return ConfigError(f"{where} has a null '{field}' field; give every record text, or set {hint}")
    return ConfigError(f"{where} field '{field}' is {type(value).__name__}, not text; set {hint}")


def _read_range(path: str, start: int, stop: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(stop - start)


def jsonl_texts(path: str, start: int, stop: int, field: str, hint: str):
    """Lists of texts from the lines in bytes [start, stop) of a JSON-lines file."""
    data, batch, size, line_start = _read_range(path, start, stop), [], 0, 0
    while line_start < len(data):
        end = data.find(b"\n", line_start)
        end = len(data) if end < 0 else end
        line = data[line_start:end]
        offset, line_start = start + line_start, end + 1
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except UnicodeDecodeError as err:
            raise _not_utf8(path, offset, err) from None
        except ValueError as err:
            raise ConfigError(f"{path}:{_line_number(path, offset)} is not valid JSON ({err.args[0].split(':')[0]}); "
                              "fix or remove that line") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{path}:{_line_number(path, offset)} is not a JSON object; each line must be an "
                              f"object with a '{field}' field")
        if field not in record:
            if _is_conversation(record):
                raise ConfigError(f"{path}:{_line_number(path, offset)} holds a conversation ('{_conversation_key(record)}'), "
                                  "not plain text; prepare it with --chat --seq-len N (chat templates and loss masks)")
            raise ConfigError(f"{path}:{_line_number(path, offset)} has no field '{field}'; set {hint}")
        if not isinstance(record[field], str):
            raise _not_text(record[field], f"{path}:{_line_number(path, offset)}", field, hint)
        batch.append(record[field])
        size += len(line)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def text_pieces(path: str, start: int, stop: int):
    """Pieces of about BATCH_BYTES of the text in bytes [start, stop), cut at line ends."""
    data, at = _read_range(path, start, stop), 0
    while at < len(data):
        cut = data.find(b"\n", at + BATCH_BYTES)
        cut = len(data) if cut < 0 else cut + 1
        try:
            yield data[at:cut].decode("utf-8")
        except UnicodeDecodeError as err:
            raise _not_utf8(path, start + at, err) from None
        at = cut


def _open_parquet(path: Path):
    pa = _pyarrow(path)
    try:
        return pa.parquet.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise ConfigError(f"{path} is not a readable parquet file ({err})") from None


def _column_texts(batches, path: str, field: str, hint: str, first_row: int, row_word: str):
    """Lists of texts from record batches, checking the column's presence, type and nulls."""
    import pyarrow as pa

    row = first_row
    for batch in batches:
        if field not in batch.schema.names:
            raise ConfigError(f"{path} has no column '{field}' (it has {', '.join(batch.schema.names)}); set {hint}")
        column = batch.column(field)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise ConfigError(f"{path} column '{field}' holds {column.type}, not text; set {hint}")
        if column.null_count:
            first_null = next(i for i, v in enumerate(column.is_null().to_pylist()) if v)
            raise ConfigError(f"{path} {row_word} {row + first_null + 1} has a null '{field}' field; give "
                              f"every record text, or set {hint}")
        yield column.to_pylist()
        row += len(column)


def parquet_texts(path: str, start: int, stop: int, first_row: int, field: str, hint: str):
    pq = _open_parquet(Path(path))
    if field not in pq.schema_arrow.names:
        raise ConfigError(f"{path} has no column '{field}' (it has {', '.join(pq.schema_arrow.names)}); set {hint}")
    batches = pq.iter_batches(batch_size=BATCH_ROWS, row_groups=range(start, stop), columns=[field])
    yield from _column_texts(batches, path, field, hint, first_row, "row")


def arrow_texts(path: str, field: str, hint: str):
    """A `datasets.save_to_disk` Arrow file (IPC stream; IPC file format also accepted), batch by batch."""
    pa = _pyarrow(Path(path))
    source = pa.memory_map(path)  # batches are views of the mapped file, not copies
    try:
        reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        try:
            file_reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid as err:
            raise ConfigError(f"{path} is not a readable Arrow file ({err})") from None
        reader = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
    yield from _column_texts(reader, path, field, hint, 0, "row")


def _piece_texts(piece: Piece, field: str, hint: str):
    if piece.kind == "text":
        first = piece.start == 0  # the file's document starts with its first part (even if empty)
        for part in text_pieces(piece.path, piece.start, piece.stop):
            yield [part], first
            first = False
        if piece.stop == os.path.getsize(piece.path):
            yield ["\n"], first  # the separator after the file's document
        return
    if piece.kind == "jsonl":
        batches = jsonl_texts(piece.path, piece.start, piece.stop, field, hint)
    elif piece.kind == "parquet":
        batches = parquet_texts(piece.path, piece.start, piece.stop, piece.first_row, field, hint)
    else:
        batches = arrow_texts(piece.path, field, hint)
    for texts in batches:
        yield [t + "\n" for t in texts], True


def unit_texts(unit: list[dict], field: str, hint: str):
    """(texts, starts_document) pairs for one unit; a text file's parts continue its one document."""
    for piece in unit:
        yield from _piece_texts(Piece(**piece), field, hint)


def file_documents(path: Path, field: str, hint: str):
    """Whole documents of one file, for the raw-file training path (small data)."""
    kind = KINDS.get(path.suffix, "text")
    if kind == "text":
        yield "".join(text_pieces(str(path), 0, path.stat().st_size))
    elif kind == "jsonl":
        for texts in jsonl_texts(str(path), 0, path.stat().st_size, field, hint):
            yield from texts
    elif kind == "parquet":
        groups = _open_parquet(path).metadata.num_row_groups
        for texts in parquet_texts(str(path), 0, groups, 0, field, hint):
            yield from texts
    else:
        for texts in arrow_texts(str(path), field, hint):
            yield from texts
