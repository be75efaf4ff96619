"""Text in, global batches out.

- Corpus: the built-in one (this Python's own standard-library sources: real text on every machine,
  no download) or local .txt / .jsonl / .parquet files.
- Tokenizer: bytes by default (vocab 256), or any Hugging Face `tokenizer.json`.
- Packing: the token stream is cut into windows of seq_len+1 tokens (inputs + shifted labels).
- Sampling: the global batch of step k is a function of (seed, data, k) only. Each epoch is a seeded
  permutation of the windows and step k takes the next `global_batch` of them; a data-parallel rank
  then takes its contiguous slice. So the layout never changes which sequences a step sees, and the
  sampler's position is just the step number.
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fivefold.config import ConfigError, DataConfig

TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl", ".parquet")


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


def _file_documents(path: Path, text_field: str):
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    record = json.loads(line)
                    if text_field not in record:
                        raise ConfigError(f"{path}:{number} has no field '{text_field}'; set data.text_field")
                    yield record[text_field]
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(f"reading {path} needs pyarrow; run `pip install pyarrow`") from None
        table = pq.read_table(path, columns=[text_field])
        yield from table.column(text_field).to_pylist()
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


def documents(cfg: DataConfig):
    if cfg.source == "builtin":
        yield from builtin_documents(cfg.builtin_max_bytes)
        return
    source = Path(cfg.source)
    files = sorted(p for p in source.rglob("*") if p.suffix in TEXT_SUFFIXES) if source.is_dir() else [source]
    if not files:
        raise ConfigError(f"data.source '{cfg.source}' holds no {'/'.join(TEXT_SUFFIXES)} files")
    for path in files:
        yield from _file_documents(path, cfg.text_field)


def tokenize_corpus(cfg: DataConfig, tokenizer) -> np.ndarray:
    """All documents, tokenized and concatenated (a newline between documents)."""
    parts = [tokenizer.encode(doc + "\n") for doc in documents(cfg)]
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return tokens


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
    """Window indices of step k's global batch, a function of (seed, number of windows, k) only."""

    def __init__(self, num_windows: int, global_batch: int, seed: int):
        self.num_windows, self.global_batch, self.seed = num_windows, global_batch, seed
        self.step = 0  # position: the next step to draw; saved and restored with checkpoints
        self._epoch_cache: dict[int, torch.Tensor] = {}

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._epoch_cache:
            generator = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._epoch_cache = {epoch: torch.randperm(self.num_windows, generator=generator)}
        return self._epoch_cache[epoch]

    def indices(self, step: int) -> torch.Tensor:
        start = step * self.global_batch
        picked = []
        while len(picked) < self.global_batch:
            epoch, offset = divmod(start + len(picked), self.num_windows)
            take = min(self.num_windows - offset, self.global_batch - len(picked))
            picked.extend(self._epoch_order(epoch)[offset: offset + take].tolist())
        return torch.tensor(picked)

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
