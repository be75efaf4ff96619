"""`fivefold prepare SRC... --tokenizer byte|FILE --out DIR`: tokenize once, train from memory maps.

The inputs are cut into units (`readers.plan_units`: ~UNIT_BYTES of text or parquet row groups, a
large file cut at line ends, small files grouped, an Arrow file whole) and worker processes tokenize one unit each into one shard, `shard_NNNNN.bin`
(uint16 tokens when the vocabulary fits, else uint32), with the unit's document starts beside it.
Every file is written under a temporary name and renamed when complete, so a killed prepare keeps
its finished shards: run the same command again and it does only the rest. When all shards exist
the per-shard indexes are joined into `documents.npy` (start offset of every document in the
stream) and `manifest.json` is written last. The output depends only on the inputs, the
tokenizer and the unit size, never on the worker count or on interruptions: byte-identical.

Memory is bounded whatever the input: a worker holds one unit's text and tokens, the main
process holds the plan and counts, and at most two units per worker are in flight.

Chat data (`--chat`, prepare_chat.py) goes through the same plan, resume and manifest: its settings
join the plan (so its digest), and its worker packs conversations into bins and writes a loss mask
and the unit's counts beside the shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from array import array
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

import numpy as np

from fivefold.config import ConfigError
from fivefold.config.file_errors import need_output_folder, os_problem, verb
from fivefold.config.tokenizer_file import parse_tokenizer, read_tokenizer, tokenizer_bytes
from fivefold.data.readers import list_files, plan_units, unit_texts
from fivefold.config.manifest import FORMAT
from fivefold.data.token_shards import DOCUMENTS, MANIFEST

UNIT_BYTES = 32 << 20
PLAN = ".plan.json"  # an unfinished prepare: what it is making (removed when the manifest is written)
HINT = "--text-field"
# Per-shard files joined into documents.npy / the manifest and then removed (.chat.json: chat counts).
JOINED = (".docs.npy", ".chat.json")


def tokenizer_identity(tokenizer: str) -> dict:
    if tokenizer == "byte":
        return {"name": "byte", "vocab_size": 256}
    path = Path(tokenizer)
    if not path.is_file():
        raise ConfigError(f"--tokenizer '{tokenizer}' is not a file; give a Hugging Face tokenizer.json or 'byte'")
    data = tokenizer_bytes(path, "--tokenizer")
    vocab = parse_tokenizer(data, tokenizer, "--tokenizer").get_vocab_size()
    return {"name": path.name, "sha256": hashlib.sha256(data).hexdigest(), "vocab_size": vocab}


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


# ---------------------------------------------------------------- the worker's side

_ENCODERS: dict[str, object] = {}


def _encoder(tokenizer: str):
    """Batch encoding: bytes through numpy, or the `tokenizers` library's batch encoder."""
    if tokenizer not in _ENCODERS:
        if tokenizer == "byte":
            def encode(texts):
                data = [t.encode("utf-8") for t in texts]
                return np.frombuffer(b"".join(data), dtype=np.uint8), [len(d) for d in data]
        else:
            tok = read_tokenizer(tokenizer, "--tokenizer")
            batch = getattr(tok, "encode_batch_fast", tok.encode_batch)  # fast: no character offsets

            def encode(texts):
                ids = [e.ids for e in batch(texts)]
                lengths = [len(i) for i in ids]
                return np.fromiter((t for i in ids for t in i), dtype=np.int64, count=sum(lengths)), lengths
        _ENCODERS[tokenizer] = encode
    return _ENCODERS[tokenizer]


def _shard_names(out: Path, index: int) -> tuple[Path, Path]:
    return out / f"shard_{index:05d}.bin", out / f"shard_{index:05d}.docs.npy"


def tokenize_unit(unit: list[dict], index: int, out: str, tokenizer: str, dtype: str,
                  field: str) -> tuple[int, int, dict]:
    """Tokenize one unit into its shard; returns (tokens, documents, {}) (a chat unit's counts go in {})."""
    encode = _encoder(tokenizer)
    tokens_path, docs_path = _shard_names(Path(out), index)
    tmp_tokens, tmp_docs = tokens_path.with_name("." + tokens_path.name + ".tmp"), docs_path.with_name(
        "." + docs_path.name + ".tmp")
    starts, written = array("q"), 0
    with tmp_tokens.open("wb") as f:
        for texts, new_documents in unit_texts(unit, field, HINT):
            ids, lengths = encode(texts)
            if new_documents:
                starts.extend((written + np.cumsum([0] + lengths[:-1])).tolist())
            f.write(ids.astype(dtype).tobytes())
            written += len(ids)
    with tmp_docs.open("wb") as f:
        np.save(f, np.frombuffer(starts, dtype=np.int64) if starts else np.zeros(0, np.int64))
    os.replace(tmp_docs, docs_path)
    os.replace(tmp_tokens, tokens_path)  # last: the token file's presence marks a finished shard
    return written, len(starts), {}


def _worker_init() -> None:
    # One process per core: the tokenizer's own thread pool would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


# ---------------------------------------------------------------- the main process's side


def _plan(sources: list[str], tokenizer: str, field: str, unit_bytes: int, chat=None) -> dict:
    files = [p.resolve() for p in list_files(sources)]
    if chat is not None:
        from fivefold.data.prepare_chat import check_sources

        check_sources(files)
    identity = tokenizer_identity(tokenizer)
    plan = {"format": FORMAT, "version": 1, "tokenizer": identity, "dtype": token_dtype(identity["vocab_size"]),
            "text_field": field, "separator": "\n", "unit_bytes": unit_bytes,
            "sources": [{"path": str(p), "bytes": p.stat().st_size} for p in files],
            "units": plan_units(files, unit_bytes)}
    if not plan["units"]:  # every source is empty: nothing to tokenize, and no folder to make
        names = ", ".join(str(p) for p in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        raise ConfigError(f"{names} {'is' if len(files) == 1 else 'are'} empty (0 bytes of text), so there is "
                          "nothing to prepare; give fivefold prepare files that hold text")
    return plan if chat is None else {**plan, **chat.plan_fields()}


def _plan_digest(plan: dict) -> str:
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _ours(path: Path) -> bool:
    name = path.name.lstrip(".")
    return name.startswith("shard_") or name in (PLAN.lstrip("."), MANIFEST, DOCUMENTS) or name.endswith(".tmp")


def _start(out: Path, plan: dict) -> bool:
    """Make `out` ready; False when it already holds exactly this prepare, finished."""
    digest = _plan_digest(plan)
    if (out / MANIFEST).is_file():
        if json.loads((out / MANIFEST).read_text()).get("plan_sha256") == digest:
            for path in (p for suffix in JOINED for p in out.glob("*" + suffix)):  # killed while tidying up
                path.unlink()
            (out / PLAN).unlink(missing_ok=True)
            return False
        raise ConfigError(f"--out {out} already holds prepared data from other sources or settings; "
                          "delete it or choose another --out")
    if (out / PLAN).is_file():
        if _plan_digest(json.loads((out / PLAN).read_text())) == digest:
            for path in out.glob(".*.tmp"):  # writes a kill cut short: redone, never trusted
                path.unlink()
            return True  # resume: finished shards are kept
        for path in out.iterdir():  # our own unfinished work for other inputs: start again
            if _ours(path):
                path.unlink()
    elif out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty and holds no prepare; choose a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / PLAN, json.dumps(plan, sort_keys=True))
    return True


def _finished(out: Path, index: int, dtype: str, chat) -> tuple[int, int, dict] | None:
    tokens_path, docs_path = _shard_names(out, index)
    if not (tokens_path.is_file() and docs_path.is_file()):
        return None
    stats = {}
    if chat is not None:
        from fivefold.data.prepare_chat import finished_stats

        if (stats := finished_stats(out, index)) is None:
            return None
    return tokens_path.stat().st_size // np.dtype(dtype).itemsize, len(np.load(docs_path, mmap_mode="r")), stats


def _progress(enabled: bool):
    """A bar over units on a terminal; nothing when the output goes to a file or a pipe."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

    console = Console(stderr=True)
    return Progress("prepare", BarColumn(), MofNCompleteColumn(), "units", TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console, disable=not (enabled and console.is_terminal))


def _run_units(out: Path, plan: dict, todo: list[int], workers: int, advance, chat=None) -> dict[int, tuple]:
    if chat is None:
        work = tokenize_unit
        args = [(plan["units"][i], i, str(out), plan["tokenizer_path"], plan["dtype"], plan["text_field"])
                for i in todo]
    else:
        from fivefold.data import prepare_chat

        work = prepare_chat.pack_unit
        args = [(plan["units"][i], i, str(out), plan["dtype"], chat) for i in todo]
    pause = float(os.environ.get("FIVEFOLD_DEBUG_PREPARE_PAUSE_S", "0"))  # test-only: time to kill a prepare
    done = {}
    workers = min(workers, len(args))  # starting a process costs a second: no more than there are units
    if workers <= 1:
        for a in args:
            done[a[1]] = work(*a)
            advance(a[0])
            time.sleep(pause)
        return done
    import multiprocessing

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init) as pool:
        pending, queue = {}, list(reversed(args))
        try:
            while queue or pending:
                while queue and len(pending) < 2 * workers:  # a bounded number of units in flight
                    a = queue.pop()
                    pending[pool.submit(work, *a)] = a
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    a = pending.pop(future)
                    done[a[1]] = future.result()  # a worker's ConfigError is raised here
                    advance(a[0])
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    return done


def _largest_token(out: Path, n_units: int, dtype: str) -> int:
    """The largest token id over every shard, read through memory maps in bounded chunks."""
    largest = -1
    for index in range(n_units):
        path = _shard_names(out, index)[0]
        if not path.stat().st_size:  # a unit of empty texts (numpy cannot map an empty file)
            continue
        tokens = np.memmap(path, dtype=dtype, mode="r")
        for start in range(0, len(tokens), 1 << 24):
            largest = max(largest, int(tokens[start:start + (1 << 24)].max()))
        del tokens
    return largest


def _write_document_index(out: Path, counts: list[tuple]) -> None:
    """documents.npy: every document's start in the whole stream, streamed shard by shard."""
    tmp = out / ("." + DOCUMENTS + ".tmp")
    total = sum(c[1] for c in counts)
    with tmp.open("wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": (total,)})
        offset = 0
        for index, (tokens, *_) in enumerate(counts):
            starts = np.load(_shard_names(out, index)[1])
            f.write((starts + offset).astype("<i8").tobytes())
            offset += tokens
    os.replace(tmp, out / DOCUMENTS)


def prepare(sources: list[str], tokenizer: str, out: str, workers: int | None = None, text_field: str = "text",
            unit_bytes: int | None = None, progress: bool = True, chat=None) -> dict:
    """Tokenize `sources` into the prepared folder `out`; returns its manifest. `chat`: the settings
    of a chat prepare (prepare_chat.chat_settings), or None for plain text."""
    unit_bytes = unit_bytes or UNIT_BYTES
    if not sources:
        raise ConfigError("fivefold prepare needs at least one SRC (a file, folder or glob)")
    folder = need_output_folder(out, "--out", "give prepare a folder to create, or its earlier --out")
    try:
        return _prepare(sources, tokenizer, folder, workers, text_field, unit_bytes, progress, chat)
    except OSError as err:  # a worker's error arrives here too, pickled with its errno and file name
        writing = verb(err, folder) == "write"
        raise os_problem(folder, err, verb(err, folder), "or choose another --out; finished shards are kept and "
                         "the same command continues where it stopped" if writing else "") from None


def _prepare(sources, tokenizer: str, folder: Path, workers, text_field: str, unit_bytes: int, progress: bool,
             chat) -> dict:
    plan = _plan(sources, tokenizer, text_field, unit_bytes, chat)
    if not _start(folder, plan):
        return json.loads((folder / MANIFEST).read_text())
    units = plan["units"]
    counts = {i: c for i in range(len(units)) if (c := _finished(folder, i, plan["dtype"], chat)) is not None}
    todo = [i for i in range(len(units)) if i not in counts]
    with _progress(progress) as bar:
        task = bar.add_task("prepare", total=len(units), completed=len(counts))
        plan_for_workers = {**plan, "tokenizer_path": tokenizer}
        counts.update(_run_units(folder, plan_for_workers, todo, workers or os.cpu_count() or 1,
                                 lambda unit: bar.advance(task), chat))
    ordered = [counts[i] for i in range(len(units))]
    if not sum(c[0] for c in ordered):  # e.g. JSON lines whose texts are all empty
        raise ConfigError(f"the sources hold no text to tokenize (0 tokens from "
                          f"{len(plan['sources'])} file(s)); check --text-field and give files that hold text")
    _write_document_index(folder, ordered)
    shards = [{"file": _shard_names(folder, i)[0].name, "tokens": t, "documents": d, "pieces": units[i]}
              for i, (t, d, _) in enumerate(ordered)]
    manifest = {key: plan[key] for key in plan if key != "units"}
    # The largest id, so that a run checks it against model.vocab_size before its first step.
    manifest["max_token_id"] = _largest_token(folder, len(units), plan["dtype"])
    manifest.update(plan_sha256=_plan_digest(plan), tokens=sum(c[0] for c in ordered),
                    documents=sum(c[1] for c in ordered), shards=shards)
    if chat is not None:
        from fivefold.data.prepare_chat import manifest_fields

        manifest["chat"] = manifest_fields(plan, [c[2] for c in ordered])
        # The tokenizer and its chat template travel with the data: a run, its export and
        # `fivefold generate --chat` find them here (train/export.py data_tokenizer).
        from fivefold.data.chat_template import copy_tokenizer

        copy_tokenizer(Path(tokenizer), folder / "tokenizer")
    _write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    for i in range(len(units)):  # joined into documents.npy and the manifest
        stem = _shard_names(folder, i)[0].name[: -len(".bin")]
        for suffix in JOINED:
            (folder / (stem + suffix)).unlink(missing_ok=True)
    (folder / PLAN).unlink()
    return manifest


def summary(manifest: dict, out: str, seconds: float) -> str:
    rate = f", {manifest['tokens'] / seconds:,.0f} tokens/s" if seconds > 0 else ""
    chat = ""
    if "chat" in manifest:
        from fivefold.data.prepare_chat import summary_part

        chat = summary_part(manifest)
    return (f"prepared {out}: {manifest['tokens']:,} tokens ({manifest['dtype']}), {manifest['documents']:,} "
            f"documents{chat}, {len(manifest['shards'])} shards from {len(manifest['sources'])} files in "
            f"{seconds:.1f}s{rate}")
