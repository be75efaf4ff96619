"""What proving a checkpoint whole costs on load: the manifest's checks (every file's size, every
file's CRC-32) against the load itself, on one process and a checkpoint of `--gb` GB.

    OMP_NUM_THREADS=1 python benchmarks/checkpoint_verify.py [--gb 1.0] [--rounds 3]

The checkpoint is written once with fivefold's own writer (DCP, sharded_io) and its manifest; then
each round times, alternating, (a) the load of every tensor into preallocated memory, (b) the
size check alone and (c) sizes plus checksums, all from the page cache (the fastest load, so the
largest ratio). With N ranks each rank checksums 1/N of the files (checkpoint/manifest.py),
so the one-process ratio is the worst case.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from fivefold.checkpoint import manifest as checkpoint_manifest  # noqa: E402

from fivefold.checkpoint import sharded_io

TENSOR_ELEMENTS = 32 << 20  # 128 MiB fp32 tensors, as a large model's biggest weights


def write(folder: Path, gb: float) -> dict[str, torch.Tensor]:
    n = max(1, round(gb * 1e9 / (4 * TENSOR_ELEMENTS)))
    tensors = {f"model/w{i}": torch.randn(TENSOR_ELEMENTS) for i in range(n)}
    sharded_io.save({k: sharded_io.whole(t) for k, t in tensors.items()}, folder, single_process=True)
    checkpoint_manifest.write(folder, checkpoint_manifest.own_files(folder, 0))
    return {k: torch.empty_like(t) for k, t in tensors.items()}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fivefold-verify-") as tmp:
        folder = Path(tmp)
        empty = write(folder, args.gb)
        size = sum(p.stat().st_size for p in folder.iterdir())
        load = lambda: sharded_io.load({k: sharded_io.whole(t) for k, t in empty.items()}, folder,  # noqa: E731
                                       single_process=True)
        sizes_only = lambda: checkpoint_manifest.problem(folder, checksums=False)  # noqa: E731
        full = lambda: checkpoint_manifest.problem(folder)  # noqa: E731
        load()  # into the page cache
        times = {"load": [], "sizes": [], "sizes+crc32": []}
        for _ in range(args.rounds):
            times["load"].append(timed(load))
            times["sizes"].append(timed(sizes_only))
            times["sizes+crc32"].append(timed(full))
        assert full() is None
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"checkpoint of {size / 1e9:.2f} GB in {len(empty)} tensors, one process, torch {torch.__version__}, "
          f"median of {args.rounds} rounds")
    for name, seconds in median.items():
        print(f"  {name:12s} {seconds:7.3f} s  {seconds / median['load']:6.1%} of the load"
              f"  ({size / seconds / 1e9:.2f} GB/s)")


if __name__ == "__main__":
    main()
