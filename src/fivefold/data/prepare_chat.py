"""`fivefold prepare --chat`: conversations packed into bins of seq_len tokens, with a loss mask.

Supervised fine-tuning trains on the replies only, and wants every training sequence to hold whole
conversations. So the prepared stream is cut into bins of exactly `--seq-len` tokens: conversations
are packed greedily in input order, one that does not fit in the rest of the bin starts the next,
the tail of a bin is padding (its own document, never trained), and a conversation longer than a
bin is truncated to it. Beside each token shard a uint8 mask marks the trained targets
(chat_template.py finds them). Each unit packs its own bins and pads its last one, so every shard
holds whole bins: a bin never straddles shards, and a window of `seq_len` starting at a multiple of
`seq_len` is always one bin.

Everything else - units, resuming after a kill, the document index, the manifest, byte-identical
output for any worker count - is prepare.py's; this module adds the reading of chat records, the
packing, and the worker that writes one unit's shard, mask and document starts.
"""

from __future__ import annotations

import json
import os
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fivefold.config import ConfigError
from fivefold.data.chat_template import ROLES, Renderer, Template, load_template, transformers_module
from fivefold.data.prepare import _shard_names, tokenizer_identity
from fivefold.data.readers import BATCH_ROWS, Piece, _line_number, _not_utf8, _open_parquet, _read_range

FLUSH_TOKENS = 1 << 20  # tokens gathered before a write: bounded memory, few system calls


@dataclass(frozen=True)
class ChatSettings:
    """What a chat prepare needs beside the sources; picklable, so each worker gets a copy."""

    tokenizer: str
    seq_len: int
    train_roles: tuple[str, ...]
    template: Template

    def plan_fields(self) -> dict:
        """Plan entries: everything that changes the output is here, so the plan digest covers it."""
        t = self.template
        return {"text_field": "messages", "separator": "", "loss_mask": True, "packed_seq_len": self.seq_len,
                "chat": {"template": t.name, "template_sha256": t.sha256, "train_roles": list(self.train_roles),
                         "special_tokens": t.special, "pad_id": t.pad_id}}


def chat_settings(tokenizer: str, seq_len: int, template_file: str = "",
                  train_roles: str = "assistant") -> ChatSettings:
    """The settings of `--chat`, each checked here, before any file is read or any worker starts."""
    if not seq_len:
        raise ConfigError("fivefold prepare --chat needs --seq-len L, the length of the packed training "
                          "sequences (the training run's train.seq_len)")
    if seq_len < 2:
        raise ConfigError(f"--seq-len {seq_len} is too short: a packed sequence needs at least 2 tokens")
    if tokenizer == "byte":
        raise ConfigError("fivefold prepare --chat needs a Hugging Face tokenizer.json with a chat template; "
                          "--tokenizer byte has none")
    roles = tuple(r.strip() for r in train_roles.split(",") if r.strip())
    unknown = [r for r in roles if r not in ROLES]
    if not roles or unknown:
        raise ConfigError(f"--train-roles '{train_roles}' must name roles among {', '.join(ROLES)}")
    tokenizer_identity(tokenizer)  # a missing or broken tokenizer.json: its own sentence
    template = load_template(tokenizer, template_file)
    transformers_module()  # missing: one sentence now, not one per worker later
    return ChatSettings(tokenizer, seq_len, roles, template)


def check_sources(files: list[Path]) -> None:
    for path in files:
        if path.suffix not in (".jsonl", ".parquet"):
            raise ConfigError(f"{path} is not a .jsonl or .parquet file; fivefold prepare --chat reads "
                              "conversation records from those only")


# ---------------------------------------------------------------- records


class _Place:
    """Where a record is, for error messages; a jsonl line number is counted only when one is shown."""

    def __init__(self, path: str, offset: int = -1, row: int = 0):
        self.path, self.offset, self.row = path, offset, row

    def __str__(self) -> str:
        if self.offset >= 0:
            return f"{self.path}:{_line_number(self.path, self.offset)}"
        return f"{self.path} row {self.row}"


def _jsonl_records(path: str, start: int, stop: int):
    data, line_start = _read_range(path, start, stop), 0
    while line_start < len(data):
        end = data.find(b"\n", line_start)
        end = len(data) if end < 0 else end
        line, place = data[line_start:end], _Place(path, start + line_start)
        line_start = end + 1
        if not line.strip():
            continue
        try:
            yield json.loads(line), place
        except UnicodeDecodeError as err:
            raise _not_utf8(path, place.offset, err) from None
        except ValueError as err:
            raise ConfigError(f"{place} is not valid JSON ({err.args[0].split(':')[0]}); fix or remove that "
                              "line") from None


def _parquet_records(piece: Piece):
    pq = _open_parquet(Path(piece.path))
    names = pq.schema_arrow.names
    columns = [c for c in ("messages", "prompt", "completion") if c in names]
    if "messages" not in columns and len(columns) < 2:
        raise ConfigError(f"{piece.path} has no column 'messages' nor 'prompt' and 'completion' (it has "
                          f"{', '.join(names)}); give conversations in one of those forms")
    row = piece.first_row
    for batch in pq.iter_batches(batch_size=BATCH_ROWS, row_groups=range(piece.start, piece.stop), columns=columns):
        for record in batch.to_pylist():
            row += 1
            yield record, _Place(piece.path, row=row)


def _message(message, place, n: int) -> dict:
    if not (isinstance(message, dict) and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)):
        raise ConfigError(f"{place} message {n} is not a {{role, content}} object with text content")
    if message["role"] not in ROLES:
        raise ConfigError(f"{place} message {n} role '{message['role']}' is not one of {', '.join(ROLES)}")
    # Only role and content reach the template: other keys (parquet's nulls among them) would change
    # what some templates render, and the mask contract is about role and content alone.
    return {"role": message["role"], "content": message["content"]}


def conversation(record, place, train_roles: tuple[str, ...]) -> list[dict]:
    """The messages of one record: `messages`, or `prompt` + `completion` as a user and an assistant turn."""
    if not isinstance(record, dict):
        raise ConfigError(f"{place} is not a JSON object; each record needs 'messages' or 'prompt' and 'completion'")
    if record.get("messages") is not None:
        if not isinstance(record["messages"], list) or not record["messages"]:
            raise ConfigError(f"{place} 'messages' is not a non-empty list of {{role, content}} messages")
        messages = [_message(m, place, n) for n, m in enumerate(record["messages"], 1)]
    elif isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        messages = [{"role": "user", "content": record["prompt"]},
                    {"role": "assistant", "content": record["completion"]}]
    else:
        raise ConfigError(f"{place} has neither 'messages' nor text 'prompt' and 'completion'; give each "
                          "record one of them")
    if not any(m["role"] in train_roles for m in messages[1:]):
        first = "; its first message is never trained" if messages[0]["role"] in train_roles else ""
        raise ConfigError(f"{place} has no {' or '.join(train_roles)} turn to train on "
                          f"(--train-roles {','.join(train_roles)}){first}")
    return messages


def unit_conversations(unit: list[dict], train_roles: tuple[str, ...]):
    """(messages, place) of every record of a unit, in order."""
    for raw in unit:
        piece = Piece(**raw)
        records = (_jsonl_records(piece.path, piece.start, piece.stop) if piece.kind == "jsonl"
                   else _parquet_records(piece))
        for record, place in records:
            yield conversation(record, place, train_roles), place


# ---------------------------------------------------------------- packing


class Packer:
    """Greedy packing into bins of seq_len tokens, streamed to a token file and a mask file."""

    def __init__(self, tokens_file, mask_file, seq_len: int, pad_id: int, dtype: str):
        self.tokens_file, self.mask_file = tokens_file, mask_file
        self.seq_len, self.pad_id, self.dtype = seq_len, pad_id, dtype
        self.starts = array("q")  # every conversation's and every padding run's start
        self.written = 0  # tokens in the unit so far (buffered or not)
        self.used = 0  # tokens in the current bin
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.buffered = 0
        self.stats = {"conversations": 0, "truncated": 0, "trained_tokens": 0, "pad_tokens": 0}

    def _put(self, ids: np.ndarray, mask: np.ndarray) -> None:
        self.starts.append(self.written)
        self.ids.append(ids)
        self.masks.append(mask)
        self.written += len(ids)
        self.buffered += len(ids)
        self.used = (self.used + len(ids)) % self.seq_len
        if self.buffered >= FLUSH_TOKENS:
            self.flush()

    def _pad(self) -> None:
        """Fill the rest of the current bin: padding is a document of its own, never trained."""
        if self.used:
            n = self.seq_len - self.used
            self.stats["pad_tokens"] += n
            self._put(np.full(n, self.pad_id, dtype=np.int64), np.zeros(n, dtype=bool))

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        if len(ids) == 0:
            return  # a template that renders nothing: no tokens, no document
        if len(ids) > self.seq_len:
            ids, mask = ids[: self.seq_len], mask[: self.seq_len]
            self.stats["truncated"] += 1
        if self.used + len(ids) > self.seq_len:
            self._pad()
        self.stats["conversations"] += 1
        self.stats["trained_tokens"] += int(mask.sum())
        self._put(ids, mask)

    def flush(self) -> None:
        if self.ids:
            self.tokens_file.write(np.concatenate(self.ids).astype(self.dtype).tobytes())
            self.mask_file.write(np.concatenate(self.masks).astype(np.uint8).tobytes())
        self.ids, self.masks, self.buffered = [], [], 0

    def close(self) -> None:
        self._pad()  # the unit's last bin: every shard holds whole bins
        self.flush()


# ---------------------------------------------------------------- the worker


def mask_name(tokens_path: Path) -> Path:
    """shard_NNNNN.bin -> shard_NNNNN.mask.bin (the name TokenShards reads)."""
    return tokens_path.with_name(tokens_path.name[: -len(".bin")] + ".mask.bin")


def stats_name(tokens_path: Path) -> Path:
    """The unit's counts, kept until the manifest sums them (a resumed prepare reads them back)."""
    return tokens_path.with_name(tokens_path.name[: -len(".bin")] + ".chat.json")


def _tmp(path: Path) -> Path:
    return path.with_name("." + path.name + ".tmp")


_RENDERERS: dict[str, Renderer] = {}


def pack_unit(unit: list[dict], index: int, out: str, dtype: str, chat: ChatSettings) -> tuple[int, int, dict]:
    """Render, mask and pack one unit into its shard; returns (tokens, documents, counts)."""
    key = json.dumps([chat.tokenizer, chat.template.text, chat.plan_fields()], sort_keys=True)
    if key not in _RENDERERS:  # one per process: loading the tokenizer costs more than a small unit
        _RENDERERS[key] = Renderer(chat.tokenizer, chat.template, chat.train_roles)
    renderer = _RENDERERS[key]
    tokens_path, docs_path = _shard_names(Path(out), index)
    mask_path, stats_path = mask_name(tokens_path), stats_name(tokens_path)
    with _tmp(tokens_path).open("wb") as tokens_file, _tmp(mask_path).open("wb") as mask_file:
        packer = Packer(tokens_file, mask_file, chat.seq_len, chat.template.pad_id, dtype)
        for messages, place in unit_conversations(unit, chat.train_roles):
            packer.add(*renderer.encode(messages, place))
        packer.close()
    with _tmp(docs_path).open("wb") as f:
        np.save(f, np.frombuffer(packer.starts, dtype=np.int64) if packer.starts else np.zeros(0, np.int64))
    _tmp(stats_path).write_text(json.dumps(packer.stats, sort_keys=True))
    for path in (mask_path, stats_path, docs_path, tokens_path):  # the token file last: it marks a finished shard
        os.replace(_tmp(path), path)
    return packer.written, len(packer.starts), packer.stats


def finished_stats(out: Path, index: int) -> dict | None:
    """A finished unit's counts, or None when its mask or counts are missing (then it is redone)."""
    tokens_path = _shard_names(out, index)[0]
    if not (mask_name(tokens_path).is_file() and stats_name(tokens_path).is_file()):
        return None
    return json.loads(stats_name(tokens_path).read_text())


def manifest_fields(plan: dict, stats: list[dict]) -> dict:
    """The manifest's `chat` entry: the plan's settings and the units' counts summed."""
    totals = {key: sum(s[key] for s in stats) for key in ("conversations", "truncated", "trained_tokens",
                                                          "pad_tokens")}
    return {**plan["chat"], **totals}


def summary_part(manifest: dict) -> str:
    chat = manifest["chat"]
    share = chat["trained_tokens"] / manifest["tokens"] if manifest["tokens"] else 0.0
    return (f", {chat['conversations']:,} conversations ({chat['truncated']:,} truncated to "
            f"{manifest['packed_seq_len']}), {share:.1%} of tokens trained")
