"""Text in, global batches out.

- Corpus: a prepared folder (`fivefold prepare`: memory-mapped token shards, `token_shards.py`), a
  weighted mixture of them (`data.mix`, `mixture.py`), or, for small data tokenized at start-up,
  the built-in one (this Python's own standard-library sources: real text on every machine, no
  download) or local .txt / .jsonl / .parquet / .arrow files (`readers.py`, streamed).
- Tokenizer: bytes by default (vocab 256), or any Hugging Face `tokenizer.json`.
- Packing: the token stream is cut into windows of seq_len+1 tokens (inputs + shifted labels).
- Sampling: the global batch of step k is a function of (seed, data, k) only. Each epoch is a seeded
  permutation of the windows and step k takes the next `global_batch` of them; a data-parallel rank
  then takes its contiguous slice. So the layout never changes which sequences a step sees, and the
  sampler's position is just the step number.
- Held out: the tail of the stream for small data; whole documents spread over the corpus for a
  prepared folder.
- Documents (`data.document_mask`): each window comes with every token's document id (from the
  prepared document index, or the document starts recorded while tokenizing small data) and, with
  `data.document_positions`, its position in its document, for attention that stays inside
  documents (models/attention/documents.py). Ids only need to differ between neighbouring documents, so
  each window's are renumbered 0, 1, 2... from its first token.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fivefold.config import ConfigError, DataConfig
from fivefold.config.tokenizer_file import read_tokenizer
from fivefold.config.validate_data import check_documents, parse_mix
from fivefold.models.attention.documents import document_positions
from fivefold.parallel.context.apply import DocumentWindows
from fivefold.data.mixture import GlobalBatches
from fivefold.data.permutation import permute
from fivefold.data.readers import SUFFIXES, file_documents, folder_files
from fivefold.data.token_shards import is_prepared, prepared_splits


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json (no transformers needed)."""

    def __init__(self, path: str, role: str = "data.tokenizer"):
        self._tok = read_tokenizer(path, role)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def build_tokenizer(cfg: DataConfig):
    return ByteTokenizer() if cfg.tokenizer == "byte" else HFTokenizer(cfg.tokenizer)


def builtin_documents(max_bytes: int):
    """The standard library's .py files, in sorted order, up to `max_bytes` of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parent.name or path.name.startswith("test_"):
            continue  # test files are full of long data literals: less language-like
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield text
        total += len(text)
        if total >= max_bytes:
            return


def documents(cfg: DataConfig):
    """The raw-file path's documents, one at a time (parquet and Arrow by batches, jsonl by lines)."""
    if cfg.source == "builtin":
        yield from builtin_documents(cfg.builtin_max_bytes)
        return
    source = Path(cfg.source)
    files = folder_files(source) if source.is_dir() else [source]
    if not files:
        raise ConfigError(f"data.source '{cfg.source}' holds no {'/'.join(SUFFIXES)} files")
    for path in files:
        yield from file_documents(path, cfg.text_field, "data.text_field")


def tokenize_corpus(cfg: DataConfig, tokenizer) -> np.ndarray:
    """All documents, tokenized and concatenated (a newline after each document). Documents are
    tokenized one at a time into int32 pieces, so only the tokens (not the text) are held whole."""
    return tokenize_documents(cfg, tokenizer)[0]


def tokenize_documents(cfg: DataConfig, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(tokens as `tokenize_corpus`, the offset where each document starts)."""
    parts = [tokenizer.encode(doc + "\n") for doc in documents(cfg)]
    starts = np.cumsum([0] + [len(p) for p in parts[:-1]]) if parts else np.zeros(0, dtype=np.int64)
    return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)), starts.astype(np.int64)


@dataclass
class Split:
    """Windows of seq_len+1 tokens over one token stream; window i starts at i*seq_len."""

    tokens: torch.Tensor
    seq_len: int
    document_starts: np.ndarray | None = None  # offset in `tokens` of each document's first token

    @property
    def num_windows(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def windows(self, indices: torch.Tensor) -> torch.Tensor:
        offsets = indices[:, None] * self.seq_len + torch.arange(self.seq_len + 1)
        return self.tokens[offsets]


def load_splits(cfg: DataConfig, seq_len: int, vocab_size: int) -> tuple[Split, Split]:
    tokenizer = build_tokenizer(cfg)
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size="
                          f"{vocab_size}; raise model.vocab_size to at least {tokenizer.vocab_size}")
    corpus, starts = tokenize_documents(cfg, tokenizer)
    if cfg.document_mask:
        check_documents(f"data.source '{cfg.source}'", len(starts))
    tokens = torch.from_numpy(corpus.astype(np.int64))
    n_train = len(tokens) - int(len(tokens) * cfg.val_fraction)
    # The held-out tail starts inside a document: that piece is its first document.
    val_starts = np.concatenate([[0], starts[starts > n_train] - n_train])
    train = Split(tokens[:n_train], seq_len, starts[starts < n_train])
    val = Split(tokens[n_train:], seq_len, val_starts)
    if train.num_windows == 0:
        raise ConfigError(f"data.source '{cfg.source}' has {len(tokens)} tokens, too few for one "
                          f"window of train.seq_len={seq_len}; add text or lower train.seq_len")
    return train, val


class GlobalBatchSampler:
    """Window indices of step k's global batch, a function of (seed, number of windows, k) only.
    Draw j of the run is element j mod n of epoch j // n's seeded permutation, computed lazily
    (`permutation.permute`), so no rank ever holds an epoch's order."""

    def __init__(self, num_windows: int, global_batch: int, seed: int):
        self.num_windows, self.global_batch, self.seed = num_windows, global_batch, seed
        self.step = 0  # position: the next step to draw; saved and restored with checkpoints

    def window_at(self, draws: np.ndarray) -> np.ndarray:
        draws = np.asarray(draws, dtype=np.int64)
        epochs, positions = np.divmod(draws, self.num_windows)
        return permute(self.num_windows, self.seed, epochs, positions)

    def indices(self, step: int) -> torch.Tensor:
        start = step * self.global_batch
        return torch.from_numpy(self.window_at(np.arange(start, start + self.global_batch)))

    def next_indices(self) -> torch.Tensor:
        indices = self.indices(self.step)
        self.step += 1
        return indices

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "num_windows": self.num_windows,
                "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_windows", "global_batch"):
            if state[key] != getattr(self, key):
                raise ConfigError(f"the saved data position was made with {key}={state[key]}, this run "
                                  f"has {getattr(self, key)}; resume with the same data and batch settings")
        self.step = state["step"]


def rank_slice(batch: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """The contiguous share of a global batch that data-parallel rank `rank` of `ranks` trains on."""
    per_rank = batch.shape[0] // ranks
    return batch[rank * per_rank: (rank + 1) * per_rank]


def window_documents(split, indices: np.ndarray) -> np.ndarray:
    """(len(indices), seq_len+1): the index in its corpus of the document each token of these
    windows belongs to (an in-memory `Split` or a prepared folder's `MappedSplit`)."""
    offsets = np.asarray(indices, dtype=np.int64)[:, None] * split.seq_len + np.arange(split.seq_len + 1)
    if isinstance(split, Split):
        return np.searchsorted(split.document_starts, offsets, side="right") - 1
    # A prepared split joins token ranges of the stream (cut at document starts) end to end.
    piece = np.searchsorted(split.range_starts, offsets, side="right") - 1
    begins = np.array([a for a, _ in split.ranges], dtype=np.int64)
    stream = begins[piece] + offsets - split.range_starts[piece]
    return np.searchsorted(split.shards.document_starts, stream, side="right") - 1


class DocumentBatches(GlobalBatches):
    """Global batches whose windows carry each token's document id (and its position in its
    document when `restart_positions`): the same windows, in the same order, as GlobalBatches."""

    def __init__(self, *args, restart_positions: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.restart_positions = restart_positions

    def rank_batch(self, step: int, rank: int = 0, ranks: int = 1) -> DocumentWindows:
        tokens = super().rank_batch(step, rank, ranks)
        per_rank = self.global_batch // ranks
        slots = step * self.global_batch + np.arange(rank * per_rank, (rank + 1) * per_rank)
        # The window of each slot, as GlobalBatches.rank_batch draws it (mixture.py).
        if self.schedule is None:
            sources, draws = np.zeros(len(slots), np.int64), slots
        else:
            sources, draws = self.schedule.assign(slots)
        ids = np.empty(tokens.shape, dtype=np.int64)
        masked = any(getattr(split, "has_loss_mask", False) for split in self.splits)
        trained = torch.ones(tokens.shape, dtype=torch.bool) if masked else None
        for s in np.unique(sources):
            here = sources == s
            windows = self.orders[s].window_at(draws[here])
            ids[here] = window_documents(self.splits[s], windows)
            if masked:  # chat data: which tokens are trained targets (a plain source in a mix: all)
                trained[torch.from_numpy(here)] = self.splits[s].loss_masks(windows)
        renumbered = np.zeros_like(ids)  # 0, 1, 2... from each window's first token
        renumbered[:, 1:] = np.cumsum(ids[:, 1:] != ids[:, :-1], axis=1)
        documents = torch.from_numpy(renumbered)
        return DocumentWindows(tokens, documents, document_positions(documents) if self.restart_positions else None,
                               trained)


def load_training_data(cfg: DataConfig, seq_len: int, vocab_size: int, global_batch: int,
                       seed: int) -> tuple[GlobalBatches, GlobalBatches]:
    """(train, held-out) global batches for any data source; held-out batches use seed+1.
    With `data.document_mask` their windows carry document ids (DocumentBatches)."""
    def batches(*args):
        if cfg.document_mask:
            return DocumentBatches(*args, restart_positions=cfg.document_positions)
        return GlobalBatches(*args)

    if cfg.mix or is_prepared(cfg.source):
        entries = parse_mix(cfg.mix) if cfg.mix else [(cfg.source, 1.0)]
        pairs = [prepared_splits(folder, seq_len, cfg.val_fraction) for folder, _ in entries]
        for (folder, _), (train, _) in zip(entries, pairs):
            if train.num_windows == 0:
                raise ConfigError(f"'{folder}' has {train.num_tokens} training tokens, too few for one window "
                                  f"of train.seq_len={seq_len}; add text or lower train.seq_len")
            if cfg.document_mask:
                check_documents(f"the prepared folder '{folder}'", len(train.shards.document_starts))
        names, weights = [f for f, _ in entries], [w for _, w in entries]
        train_batches = batches([p[0] for p in pairs], names, weights, global_batch, seed)
        # A source too small to hold documents out (or val_fraction = 0) is left out of evaluation.
        held = [(f, w, p[1]) for (f, w), p in zip(entries, pairs) if p[1].num_windows] or \
            [(f, w, p[1]) for (f, w), p in zip(entries, pairs)]
        total = sum(w for _, w, _ in held)
        val_batches = batches([v for _, _, v in held], [f for f, _, _ in held],
                              [w / total for _, w, _ in held], global_batch, seed + 1)
        return train_batches, val_batches
    train, val = load_splits(cfg, seq_len, vocab_size)
    return (batches([train], [cfg.source], [1.0], global_batch, seed),
            batches([val], [cfg.source], [1.0], global_batch, seed + 1))
