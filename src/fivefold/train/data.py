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
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fivefold.config import ConfigError, DataConfig
from fivefold.train.mixture import GlobalBatches, parse_mix
from fivefold.train.permutation import permute
from fivefold.train.readers import SUFFIXES, file_documents, folder_files
from fivefold.train.token_shards import is_prepared, prepared_splits


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json (no transformers needed)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(path)
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
    parts = [tokenizer.encode(doc + "\n") for doc in documents(cfg)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


@dataclass
class Split:
    """Windows of seq_len+1 tokens over one token stream; window i starts at i*seq_len."""

    tokens: torch.Tensor
    seq_len: int

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
    tokens = torch.from_numpy(tokenize_corpus(cfg, tokenizer).astype(np.int64))
    n_val = int(len(tokens) * cfg.val_fraction)
    train, val = Split(tokens[: len(tokens) - n_val], seq_len), Split(tokens[len(tokens) - n_val:], seq_len)
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


def load_training_data(cfg: DataConfig, seq_len: int, vocab_size: int, global_batch: int,
                       seed: int) -> tuple[GlobalBatches, GlobalBatches]:
    """(train, held-out) global batches for any data source; held-out batches use seed+1."""
    if cfg.mix or is_prepared(cfg.source):
        entries = parse_mix(cfg.mix) if cfg.mix else [(cfg.source, 1.0)]
        pairs = [prepared_splits(folder, seq_len, cfg.val_fraction) for folder, _ in entries]
        for (folder, _), (train, _) in zip(entries, pairs):
            if train.num_windows == 0:
                raise ConfigError(f"'{folder}' has {train.num_tokens} training tokens, too few for one window "
                                  f"of train.seq_len={seq_len}; add text or lower train.seq_len")
        names, weights = [f for f, _ in entries], [w for _, w in entries]
        train_batches = GlobalBatches([p[0] for p in pairs], names, weights, global_batch, seed)
        # A source too small to hold documents out (or val_fraction = 0) is left out of evaluation.
        held = [(f, w, p[1]) for (f, w), p in zip(entries, pairs) if p[1].num_windows] or \
            [(f, w, p[1]) for (f, w), p in zip(entries, pairs)]
        total = sum(w for _, w, _ in held)
        val_batches = GlobalBatches([v for _, _, v in held], [f for f, _, _ in held],
                                    [w / total for _, w, _ in held], global_batch, seed + 1)
        return train_batches, val_batches
    train, val = load_splits(cfg, seq_len, vocab_size)
    return (GlobalBatches([train], [cfg.source], [1.0], global_batch, seed),
            GlobalBatches([val], [cfg.source], [1.0], global_batch, seed + 1))
