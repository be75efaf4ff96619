"""A prepared folder (`fivefold prepare`), memory-mapped: token shards, document index, manifest.

Opening one reads the manifest (a few kilobytes per thousand shards) and maps files; no token is
read until a window asks for it, so a rank's memory and start-up time do not grow with the corpus.
The held-out split takes whole documents spread over the corpus: the documents are cut into at most
`HELD_OUT_BLOCKS` runs of consecutive documents and a fixed-seed choice of runs is held out, so the
split is a function of the data and `val_fraction` only, and costs a few hundred index lookups.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fivefold.config.confined import inside
from fivefold.config.file_errors import FileProblem, guarded, need_file
from fivefold.config.manifest import MANIFEST, read_manifest

DOCUMENTS = "documents.npy"
HELD_OUT_BLOCKS = 1024
HELD_OUT_SEED = 20261201  # fixed: the held-out documents must not move when train.seed does


def is_prepared(folder: str) -> bool:
    return (Path(folder) / MANIFEST).is_file()


class TokenShards:
    """The concatenated token stream of a prepared folder, read through memory maps."""

    def __init__(self, folder: str):
        self.folder = Path(folder)
        self.manifest = read_manifest(folder)
        self.dtype = np.dtype(self.manifest["dtype"])
        # the manifest is untrusted input: every shard it lists lies inside the folder
        self.files = [inside(self.folder, s["file"], self.folder / MANIFEST) for s in self.manifest["shards"]]
        sizes = np.array([s["tokens"] for s in self.manifest["shards"]], dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(sizes)])
        self.num_tokens = int(self.shard_starts[-1])
        self.vocab_size = int(self.manifest["tokenizer"]["vocab_size"])
        self._maps: dict[int, np.memmap] = {}
        docs = self.folder / DOCUMENTS
        self.document_starts = self._document_index(docs) if self.manifest["documents"] else np.zeros(0, np.int64)
        # Chat data (`fivefold prepare --chat`): a uint8 loss mask beside each shard, and the length of
        # the bins its conversations are packed into (0 for plain text).
        self.has_loss_mask = bool(self.manifest.get("loss_mask"))
        self.packed_seq_len = int(self.manifest.get("packed_seq_len", 0))
        self.mask_files = [f.with_name(f.name[:-len(".bin")] + ".mask.bin") for f in self.files]
        self._mask_maps: dict[int, np.memmap] = {}
        self._check_sizes()

    def check_ids(self, tokens: np.ndarray) -> None:
        """Every id below the tokenizer's vocabulary (itself at most model.vocab_size, validated):
        a shard altered after `prepare`, or a manifest that understates its largest id, is one
        sentence instead of an index error inside the model's embedding. A max over the batch."""
        largest = int(tokens.max()) if tokens.size else 0
        if largest >= self.vocab_size or (tokens.size and int(tokens.min()) < 0):
            raise FileProblem(f"{self.folder} holds token id {largest}, but its tokenizer has {self.vocab_size} "
                              f"tokens ({self.folder / MANIFEST}): the shards were altered after they were "
                              f"prepared; {self._fix()}")

    def _fix(self) -> str:
        return f"prepare the folder again (`fivefold prepare SRC... --out {self.folder}`) or restore it from a copy"

    def _check_sizes(self) -> None:
        """Every shard (and loss mask) as long as the manifest says, before the first step: a file cut
        short by a copy or a full disk would otherwise fail, or read garbage, in the middle of a run.
        One stat per file; no token is read."""
        shards = self.manifest["shards"]
        for files, per_token, kind in ((self.files, self.dtype.itemsize, "token shard"),
                                       (self.mask_files if self.has_loss_mask else [], 1, "loss mask")):
            for path, shard in zip(files, shards):
                need_file(path, kind, f"it is listed in {self.folder / MANIFEST}; {self._fix()}")
                with guarded(path, "read", self._fix()):
                    size = path.stat().st_size
                if size != shard["tokens"] * per_token:
                    raise FileProblem(f"{kind} {path} is {size} bytes, but {self.folder / MANIFEST} lists "
                                      f"{shard['tokens']} tokens ({shard['tokens'] * per_token} bytes): it was cut "
                                      f"short or changed after it was prepared; {self._fix()}")

    def _document_index(self, docs: Path) -> np.ndarray:
        need_file(docs, "document index", f"it belongs to {self.folder / MANIFEST}; {self._fix()}")
        with guarded(docs, "read", self._fix(), "document index (.npy)", formats=(ValueError, EOFError)):
            starts = np.load(docs, mmap_mode="r")
        if starts.ndim != 1 or len(starts) != self.manifest["documents"]:
            raise FileProblem(f"document index {docs} holds {len(starts)} entries, but {self.folder / MANIFEST} "
                              f"lists {self.manifest['documents']} documents; {self._fix()}")
        return starts

    def _shard(self, i: int) -> np.ndarray:
        if i not in self._maps:  # opened on first use: start-up cost independent of the shard count
            self._maps[i] = np.memmap(self.files[i], dtype=self.dtype, mode="r")
        return self._maps[i]

    def _mask_shard(self, i: int) -> np.ndarray:
        if i not in self._mask_maps:
            self._mask_maps[i] = np.memmap(self.mask_files[i], dtype=np.uint8, mode="r")
        return self._mask_maps[i]

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the stream, as int64 (may span shards)."""
        return self._gather(start, length, self._shard, np.int64)

    def read_mask(self, start: int, length: int) -> np.ndarray:
        """The loss mask of tokens [start, start+length) (True = a trained target); chat data only."""
        return self._gather(start, length, self._mask_shard, np.bool_)

    def _gather(self, start: int, length: int, shard_of, dtype) -> np.ndarray:
        out = np.empty(length, dtype=dtype)
        done = 0
        shard = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        while done < length:
            offset = start + done - int(self.shard_starts[shard])
            piece = shard_of(shard)[offset: offset + length - done]
            out[done: done + len(piece)] = piece
            done += len(piece)
            shard += 1
        return out


def held_out_ranges(shards: TokenShards, val_fraction: float) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, held-out) token ranges of the stream, cut at document starts."""
    n_docs = len(shards.document_starts)
    if val_fraction <= 0 or n_docs < 2:
        return [(0, shards.num_tokens)], []
    if shards.packed_seq_len:  # chat data: hold out whole bins, so every range keeps windows on bins
        return _held_out_units(shards.num_tokens, np.arange(0, shards.num_tokens, shards.packed_seq_len),
                               val_fraction)
    return _held_out_units(shards.num_tokens, shards.document_starts, val_fraction)


def _held_out_units(num_tokens: int, unit_starts, val_fraction: float):
    n_docs = len(unit_starts)
    if n_docs < 2:
        return [(0, num_tokens)], []
    n_blocks = min(n_docs, HELD_OUT_BLOCKS)
    n_val = min(n_blocks - 1, max(1, round(val_fraction * n_blocks)))
    held = set(np.random.default_rng(HELD_OUT_SEED).permutation(n_blocks)[:n_val].tolist())
    first_docs = [n_docs * b // n_blocks for b in range(n_blocks)]
    edges = [0] + [int(unit_starts[d]) for d in first_docs[1:]] + [num_tokens]
    train, val = [], []
    for block in range(n_blocks):
        target = val if block in held else train
        if target and target[-1][1] == edges[block]:
            target[-1] = (target[-1][0], edges[block + 1])  # adjacent blocks: one range
        else:
            target.append((edges[block], edges[block + 1]))
    return train, val


class MappedSplit:
    """Windows of seq_len+1 tokens over some token ranges of a prepared folder, joined end to end;
    window i starts at i*seq_len of the joined stream (the same packing as the in-memory `Split`)."""

    def __init__(self, shards: TokenShards, ranges: list[tuple[int, int]], seq_len: int):
        self.shards, self.seq_len = shards, seq_len
        self.ranges = [(a, b) for a, b in ranges if b > a]
        lengths = np.array([b - a for a, b in self.ranges], dtype=np.int64)
        self.range_starts = np.concatenate([[0], np.cumsum(lengths)])
        self.num_tokens = int(self.range_starts[-1])

    @property
    def num_windows(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq_len)

    def _read(self, start: int, length: int, read=None) -> np.ndarray:
        read = read or self.shards.read
        parts, piece = [], int(np.searchsorted(self.range_starts, start, side="right")) - 1
        while length > 0:
            a, b = self.ranges[piece]
            begin = a + start - int(self.range_starts[piece])
            take = min(length, b - begin)
            parts.append(read(begin, take))
            start, length, piece = start + take, length - take, piece + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def windows(self, indices):
        """A (len(indices), seq_len+1) int64 torch tensor."""
        import torch  # here, not at the top: prepare's worker processes use this module without torch

        rows = [self._read(int(i) * self.seq_len, self.seq_len + 1) for i in np.asarray(indices).tolist()]
        if not rows:
            return torch.zeros(0, self.seq_len + 1, dtype=torch.int64)
        batch = np.stack(rows)
        self.shards.check_ids(batch)
        return torch.from_numpy(batch)

    @property
    def has_loss_mask(self) -> bool:
        return self.shards.has_loss_mask

    def loss_masks(self, indices):
        """(len(indices), seq_len+1) bool: which tokens of these windows are trained targets
        (all of them for plain text)."""
        import torch

        if not self.has_loss_mask:
            return torch.ones(len(indices), self.seq_len + 1, dtype=torch.bool)
        rows = [self._read(int(i) * self.seq_len, self.seq_len + 1, self.shards.read_mask)
                for i in np.asarray(indices).tolist()]
        return torch.from_numpy(np.stack(rows).astype(bool)) if rows else torch.zeros(0, self.seq_len + 1, dtype=torch.bool)


def prepared_splits(folder: str, seq_len: int, val_fraction: float) -> tuple[MappedSplit, MappedSplit]:
    shards = TokenShards(folder)
    train, val = held_out_ranges(shards, val_fraction)
    return MappedSplit(shards, train, seq_len), MappedSplit(shards, val, seq_len)
