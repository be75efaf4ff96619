"""Data at scale (issue 16): prepare throughput against `datasets`, and a 2-rank training run's
per-rank peak RSS and start-up time as the prepared corpus grows 1x -> 10x -> 100x.

    OMP_NUM_THREADS=1 python benchmarks/data.py [--mb 520] [--workers 2] [--base-mtokens 25] [--work DIR]

1. Throughput: a JSON-lines corpus of --mb megabytes (this Python's standard-library sources, one
   document per file, repeated until the size is reached) and a byte-level BPE tokenizer (vocab 8192)
   trained here on 5 MB of it. `fivefold prepare` (--workers processes) and, in the same run,
   `datasets.load_dataset("json")` + `Dataset.map(batched=True, num_proc=--workers)` with the same
   tokenizer file and the same batch encoder, each from a cold start into its own folder. Both count
   the tokens they produce (they must agree). The byte tokenizer's prepare speed is reported too.
2. Scale: the byte-tokenized corpus is prepared once (--base-mtokens million tokens = 1x); 10x and
   100x folders are synthesised by copying its shards (real copies: the 100x one is >= 5 GB of
   uint16 tokens on disk) with a joined document index and manifest. For each size two spawned gloo
   ranks train 10 steps of the tiny model from it (data.source = the folder); each reports its
   peak RSS (ru_maxrss) and its start-up seconds (train()'s wall time minus its steps' times:
   process group, model build, opening the data). Big folders are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def corpus_jsonl(path: Path, megabytes: float) -> int:
    """Standard-library sources as one JSON document per file, repeated up to `megabytes`."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for file in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        try:
            texts.append(json.dumps({"text": file.read_text(encoding="utf-8")}) + "\n")
        except (UnicodeDecodeError, OSError):
            continue
    written, target = 0, int(megabytes * 1e6)
    with path.open("w") as f:
        while written < target:
            for line in texts:
                f.write(line)
                written += len(line)
                if written >= target:
                    break
    return written


def train_tokenizer(corpus: Path, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    with corpus.open() as f:  # the first ~5 MB of documents
        sample, size = [], 0
        for line in f:
            sample.append(json.loads(line)["text"])
            size += len(line)
            if size > 5e6:
                break
    tok.train_from_iterator(sample, trainer)
    tok.save(str(out))


def _hf_map(tokenizer_path: str):
    """The `datasets` baseline's batch function: the same tokenizer file, the same batch encoder."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)

    def tokenize(batch):
        return {"ids": [e.ids for e in tok.encode_batch_fast([t + "\n" for t in batch["text"]])]}
    return tokenize


def throughput(work: Path, megabytes: float, workers: int) -> dict:
    import datasets

    from fivefold.data.prepare import prepare

    corpus = work / "corpus.jsonl"
    size = corpus_jsonl(corpus, megabytes)
    tokenizer = work / "tokenizer.json"
    train_tokenizer(corpus, tokenizer)
    rows = {"corpus_bytes": size, "workers": workers}

    start = time.perf_counter()
    ours = prepare([str(corpus)], str(tokenizer), str(work / "ours_bpe"), workers=workers, progress=False)
    rows["fivefold_s"] = time.perf_counter() - start
    rows["tokens"] = ours["tokens"]

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # as in our workers: one process per core
    datasets.disable_progress_bars()
    start = time.perf_counter()
    dataset = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(work / "hf_cache"))
    loaded = time.perf_counter()
    mapped = dataset.map(_hf_map(str(tokenizer)), batched=True, num_proc=workers, remove_columns=["text"])
    done = time.perf_counter()
    hf_tokens = sum(len(ids) for batch in mapped.iter(batch_size=10_000) for ids in batch["ids"])
    rows.update(datasets_load_s=loaded - start, datasets_map_s=done - loaded, datasets_tokens=hf_tokens)
    assert hf_tokens == ours["tokens"], (hf_tokens, ours["tokens"])
    shutil.rmtree(work / "hf_cache")
    shutil.rmtree(work / "ours_bpe")

    start = time.perf_counter()
    byte = prepare([str(corpus)], "byte", str(work / "ours_byte"), workers=workers, progress=False)
    rows.update(byte_s=time.perf_counter() - start, byte_tokens=byte["tokens"])
    shutil.rmtree(work / "ours_byte")
    corpus.unlink()
    return rows


# ---------------------------------------------------------------- scale


def repeat_prepared(src: Path, dst: Path, times: int) -> None:
    """A prepared folder holding `src`'s stream `times` over (shards copied, index re-offset)."""
    from fivefold.data.token_shards import DOCUMENTS, MANIFEST

    manifest = json.loads((src / MANIFEST).read_text())
    dst.mkdir(parents=True)
    shards, offset, docs = [], 0, np.load(src / DOCUMENTS)
    with (dst / DOCUMENTS).open("wb") as index:
        np.lib.format.write_array_header_1_0(index, {"descr": "<i8", "fortran_order": False,
                                                     "shape": (len(docs) * times,)})
        for copy in range(times):
            for shard in manifest["shards"]:
                name = f"shard_{len(shards):05d}.bin"
                shutil.copyfile(src / shard["file"], dst / name)
                shards.append({**shard, "file": name})
            index.write((docs + offset).astype("<i8").tobytes())
            offset += manifest["tokens"]
    manifest.update(shards=shards, tokens=manifest["tokens"] * times, documents=manifest["documents"] * times)
    (dst / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _rank(folder: str) -> dict:
    from fivefold.configure import load_config
    from fivefold.train.trainer import train

    from fivefold.data.batches import load_training_data

    rank = int(os.environ["RANK"])  # set by spawn.py
    cfg = load_config(None, {"parallel": {"dp": 2}, "data": {"source": folder},
                             "train": {"steps": 10, "seq_len": 256, "global_batch": 8}, "log": {"progress": False}})
    t = cfg.train
    start = time.perf_counter()  # opening the data alone: manifest, maps, held-out split, first batch
    batches, _ = load_training_data(cfg.data, t.seq_len, cfg.model.vocab_size, t.global_batch, t.seed)
    batches.rank_batch(0, rank, 2)
    data_open = time.perf_counter() - start
    start = time.perf_counter()
    records = train(cfg).records
    wall = time.perf_counter() - start
    return {"peak_rss_bytes": peak_rss_bytes(), "data_open_s": data_open,
            "startup_s": wall - sum(r["step_time_s"] for r in records), "loss": records[-1]["loss"]}


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM). Not ru_maxrss: Linux carries that across exec, so a
    spawned rank would report its parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def two_rank_run(folder: Path) -> list[dict]:
    from spawn import run_on_ranks  # imported here: torch stays out of the throughput part

    # No process group from spawn.py: train() starts its own, part of the start-up measured.
    return run_on_ranks(2, _rank, str(folder), timeout_s=900, group_timeout_s=None)


def scale(work: Path, base_mtokens: float, workers: int) -> list[dict]:
    from fivefold.data.prepare import prepare

    corpus = work / "base.jsonl"
    corpus_jsonl(corpus, base_mtokens)  # byte tokens: one per byte (+1 separator per document)
    base = work / "x1"
    prepare([str(corpus)], "byte", str(base), workers=workers, progress=False)
    corpus.unlink()
    rows = []
    for times in (1, 10, 100):
        folder = base if times == 1 else work / f"x{times}"
        if times > 1:
            repeat_prepared(base, folder, times)
        disk = sum(p.stat().st_size for p in folder.iterdir())
        ranks = two_rank_run(folder)
        rows.append({"times": times, "disk_bytes": disk, "ranks": ranks})
        print(json.dumps(rows[-1]), flush=True)
        if times > 1:
            shutil.rmtree(folder)
    shutil.rmtree(base)
    return rows


def report(tp: dict | None, sc: list[dict] | None) -> str:
    import torch

    lines = [f"torch {torch.__version__}, {os.cpu_count()} CPU cores, OMP_NUM_THREADS=1"]
    if tp:
        ours = tp["tokens"] / tp["fivefold_s"]
        hf_map = tp["tokens"] / tp["datasets_map_s"]
        hf_all = tp["tokens"] / (tp["datasets_load_s"] + tp["datasets_map_s"])
        lines += ["", f"Prepare, {tp['corpus_bytes'] / 1e6:.0f} MB of JSON lines, BPE vocab 8192, "
                      f"{tp['workers']} workers, {tp['tokens']:,} tokens (both tools count the same):", "",
                  "| pipeline | seconds | tokens/s | fivefold / it |", "|---|---|---|---|",
                  f"| `fivefold prepare` (read + tokenize + write shards) | {tp['fivefold_s']:.1f} | {ours:,.0f} | — |",
                  f"| `datasets` load_dataset('json') + map(batched, num_proc={tp['workers']}) | "
                  f"{tp['datasets_load_s'] + tp['datasets_map_s']:.1f} | {hf_all:,.0f} | {ours / hf_all:.2f}x |",
                  f"| `datasets` map alone (after its JSON -> Arrow load) | {tp['datasets_map_s']:.1f} | "
                  f"{hf_map:,.0f} | {ours / hf_map:.2f}x |",
                  f"| `fivefold prepare --tokenizer byte` | {tp['byte_s']:.1f} | {tp['byte_tokens'] / tp['byte_s']:,.0f} | — |"]
    if sc:
        first = sc[0]["ranks"]
        lines += ["", "Two ranks (dp=2, gloo) training 10 steps of the tiny model from a prepared folder "
                      "(change against 1x in brackets):", "",
                  "| corpus | on disk | peak RSS rank 0 / 1 | start-up rank 0 / 1 | opening the data rank 0 / 1 |",
                  "|---|---|---|---|---|"]
        for row in sc:
            r = row["ranks"]
            rss = " / ".join(f"{x['peak_rss_bytes'] / 1e6:.0f} MB ({x['peak_rss_bytes'] / f['peak_rss_bytes'] - 1:+.1%})"
                             for x, f in zip(r, first))
            up = " / ".join(f"{x['startup_s']:.2f} s ({x['startup_s'] - f['startup_s']:+.2f})" for x, f in zip(r, first))
            opened = " / ".join(f"{x['data_open_s'] * 1e3:.0f} ms" for x in r)
            lines.append(f"| {row['times']}x | {row['disk_bytes'] / 1e9:.2f} GB | {rss} | {up} | {opened} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=520)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--base-mtokens", type=float, default=26)
    parser.add_argument("--work", default="")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-scale", action="store_true")
    a = parser.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="fivefold-data-"))
    work.mkdir(parents=True, exist_ok=True)
    tp = None if a.skip_throughput else throughput(work, a.mb, a.workers)
    if tp:
        print(json.dumps(tp), flush=True)
    sc = None if a.skip_scale else scale(work, a.base_mtokens, a.workers)
    print(report(tp, sc))


if __name__ == "__main__":
    main()
