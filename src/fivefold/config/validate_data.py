"""The data section's checks before any process starts: the source and tokenizer files exist and
fit model.vocab_size, prepared folders and data.mix agree on one tokenizer, and document masking
has documents to keep attention inside. validate() (config/validate.py) calls `check_data`; each failure
is one sentence naming the key and the fix.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

from fivefold.config.confined import inside
from fivefold.config.errors import ConfigError, require as _require
from fivefold.config.manifest import read_manifest
from fivefold.config.schema import Config
from fivefold.config.tokenizer_file import read_tokenizer


def parse_mix(mix: str) -> list[tuple[str, float]]:
    """'DIR_A:0.7,DIR_B:0.3' -> [(DIR_A, 0.7), (DIR_B, 0.3)] (weights normalised to sum to 1)."""
    entries = []
    for part in mix.split(","):
        folder, sep, weight = part.strip().rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = float("nan")
        if not sep or not folder or not value > 0:
            raise ConfigError(f"data.mix entry '{part.strip()}' must be FOLDER:WEIGHT with a weight > 0, "
                              "e.g. data.mix = \"web:0.7,code:0.3\"")
        if any(folder == f for f, _ in entries):
            raise ConfigError(f"data.mix names '{folder}' twice; give each folder once with its total weight")
        entries.append((folder, value))
    total = sum(w for _, w in entries)
    return [(folder, w / total) for folder, w in entries]


def check_data(cfg: Config) -> None:
    """data.source, data.tokenizer and data.mix against the files they name and model.vocab_size."""
    d, m = cfg.data, cfg.model
    if not d.source and not d.mix:
        return  # not set yet (the real-size configs): `plan` and `layout` need none, a launch refuses it
    if d.mix or (Path(d.source) / "manifest.json").is_file():  # a prepared folder (token_shards.py)
        _check_prepared_data(cfg)
        return
    if d.source != "builtin":
        _require(Path(d.source).exists(), f"data.source '{d.source}' does not exist; give a text/jsonl/"
                 "parquet file or folder, or 'builtin'")
        if d.document_mask and Path(d.source).is_file() and Path(d.source).suffix not in (".jsonl", ".parquet"):
            check_documents(f"data.source '{d.source}'", 1)  # before any process starts (data/batches.py)
    if d.tokenizer == "byte":
        _require(m.vocab_size >= 256, f"model.vocab_size={m.vocab_size} is too small for the byte "
                 "tokenizer; it needs at least 256")
    else:
        _require(Path(d.tokenizer).is_file(), f"data.tokenizer '{d.tokenizer}' is not a file; give a "
                 "Hugging Face tokenizer.json or 'byte'")
        n_tokens = _tokenizer_size(d.tokenizer)
        _require(n_tokens <= m.vocab_size, f"the tokenizer has {n_tokens} tokens but model.vocab_size="
                 f"{m.vocab_size}; raise model.vocab_size to at least {n_tokens}")


def check_data_is_set(cfg: Config) -> None:
    """A launch needs data: the real-size configs leave data.source empty, so that a first run of
    one does not train a billions-of-parameters model on the demo bytes with the byte tokenizer."""
    d = cfg.data
    _require(bool(d.source or d.mix), "data.source is not set, and this config's model is not one to train on "
             "the built-in demo bytes; set data.source to your corpus (a folder from `fivefold prepare`, or "
             "text/jsonl/parquet files) and data.tokenizer to the model's tokenizer.json, or data.source = "
             "builtin to run on the demo bytes anyway")


def check_documents(what: str, n_documents: int) -> None:
    """Document masking needs a corpus of several documents; one sentence otherwise."""
    if n_documents < 2:
        raise ConfigError(f"data.document_mask = true needs documents to keep attention inside, but {what} "
                          f"holds {n_documents} document{'' if n_documents == 1 else 's'} (a text file is one "
                          "document); use a .jsonl or .parquet file (one document per line or row), a folder "
                          "of files or a prepared folder, or set data.document_mask = false")


def _check_chat_folder(cfg: Config, folder: str, manifest: dict) -> None:
    """A folder of packed conversations with a loss mask (`fivefold prepare --chat`): its bins are
    the training windows, and conversations sharing a bin must not see each other."""
    packed = manifest["packed_seq_len"]
    _require(cfg.train.seq_len == packed, f"'{folder}' holds conversations packed into sequences of {packed} "
             f"tokens (fivefold prepare --chat --seq-len {packed}) but train.seq_len={cfg.train.seq_len}; set "
             f"train.seq_len = {packed}, or prepare again with --seq-len {cfg.train.seq_len}")
    _require(cfg.data.document_mask, f"'{folder}' holds packed conversations with a loss mask; set "
             "data.document_mask = true so that conversations packed into one sequence do not attend to each other")
    _require(cfg.model.mtp_depth == 0, f"model.mtp_depth={cfg.model.mtp_depth}: multi-token prediction does not "
             f"take the loss mask of '{folder}' yet; set model.mtp_depth = 0 to fine-tune on chat data")


def _tokenizer_size(path: str) -> int:
    """The vocabulary of a tokenizer.json; one sentence when the file is not one."""
    return read_tokenizer(path, "data.tokenizer").get_vocab_size()


def _check_tokens_fit(cfg: Config, key: str, folder: str, manifest: dict) -> None:
    """A prepared folder's shards lie inside it, and its largest token id (recorded by `prepare`)
    is one the model has an embedding row for: else the first step fails on an index error."""
    shards = manifest.get("shards")
    _require(isinstance(shards, list) and all(isinstance(s, dict) and "file" in s for s in shards),
             f"{Path(folder) / 'manifest.json'} lists no shards; prepare the folder again")
    for shard in shards:
        inside(folder, shard["file"], Path(folder) / "manifest.json")
    largest = manifest.get("max_token_id")
    if isinstance(largest, int):  # folders prepared before it was recorded are checked batch by batch
        _require(largest < cfg.model.vocab_size, f"{key} folder '{folder}' holds token id {largest}, but "
                 f"model.vocab_size={cfg.model.vocab_size} gives ids 0..{cfg.model.vocab_size - 1}; raise "
                 f"model.vocab_size to at least {largest + 1}, or prepare the data with the model's tokenizer")


def _check_model_tokenizer(cfg: Config, key: str, folder: str, tokenizer: dict) -> None:
    """Data prepared with another tokenizer than the one model.init_from's folder was trained with:
    the ids would mean other tokens to the model."""
    own = Path(cfg.model.init_from) / "tokenizer.json" if cfg.model.init_from else None
    if own is None or not own.is_file():
        return
    digest = hashlib.sha256(own.read_bytes()).hexdigest()
    _require(tokenizer.get("sha256") == digest, f"{key} folder '{folder}' was prepared with the "
             f"{tokenizer['name']} tokenizer, not model.init_from's {own}; prepare it again with "
             f"`fivefold prepare SRC --tokenizer {own}`")


def _check_prepared_data(cfg: Config) -> None:
    """data.source = a prepared folder, or data.mix = several: the tokenizer is the manifest's."""
    d, m = cfg.data, cfg.model
    _require(not d.mix or d.source == "builtin", f"data.mix and data.source='{d.source}' are both set; "
             "give the folders and their weights in data.mix alone")
    weights = parse_mix(d.mix) if d.mix else []
    _require(all(math.isfinite(w) for _, w in weights), f"data.mix='{d.mix}' has a weight that is not a "
             "finite number; give each folder a weight > 0, e.g. \"web:0.7,code:0.3\"")
    folders = [folder for folder, _ in weights] if d.mix else [d.source]
    tokenizers = {}
    for folder in folders:
        key = "data.mix" if d.mix else "data.source"
        _require(Path(folder).is_dir(), f"{key} folder '{folder}' does not exist; make it with "
                 f"`fivefold prepare SRC --out {folder}`")
        manifest = read_manifest(folder)
        if manifest.get("loss_mask"):
            _check_chat_folder(cfg, folder, manifest)
        if d.document_mask:
            check_documents(f"{key} folder '{folder}'", manifest["documents"])
        _check_tokens_fit(cfg, key, folder, manifest)
        tokenizer = manifest["tokenizer"]
        _require(tokenizer["vocab_size"] <= m.vocab_size, f"'{folder}' was prepared with a tokenizer of "
                 f"{tokenizer['vocab_size']} tokens but model.vocab_size={m.vocab_size}; raise model.vocab_size "
                 f"to at least {tokenizer['vocab_size']}")
        _check_model_tokenizer(cfg, key, folder, tokenizer)
        tokenizers[folder] = tokenizer
    labels = {f: t["name"] + (f" sha256 {t['sha256'][:12]}" if "sha256" in t else "") for f, t in tokenizers.items()}
    _require(len(set(labels.values())) == 1, "data.mix folders were prepared with different tokenizers (" +
             ", ".join(f"{f}: {label}" for f, label in labels.items()) + "); prepare them all with the same one")
