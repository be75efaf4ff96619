"""What starting a group of test ranks costs: tests/ranks.py's processes forked from a server that
has preloaded torch.distributed and fivefold's trainer, against spawned ones that import them
themselves. Each group inits gloo, runs `fn` and exits; groups alternate between the two ways so
both see the same machine.

    OMP_NUM_THREADS=1 python benchmarks/rank_start.py [--ranks 4,16] [--repeats 2]

`idle`: the group only starts; `layout`: it also trains one dp2·tp2 layout of the tiny config
(what the layout tests do), for 4 ranks.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import ranks  # noqa: E402 - the tests' rank harness
from layouts import run_layout  # noqa: E402


def idle():
    return 0


def layout():
    return run_layout({"parallel": {"dp": 2, "tp": 2, "zero": 1}, "train": {"steps": 2}}).losses


def spawned():
    return mp.get_context("spawn")


def timed(context, n: int, fn, seen: dict) -> float:
    ranks._context = context
    start = time.perf_counter()
    values = ranks.run_on_ranks(n, fn)
    took = time.perf_counter() - start
    # Both ways must compute the same thing, or the comparison means nothing.
    assert seen.setdefault((n, fn.__name__), values) == values, (fn.__name__, values)
    return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="4,16")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    forked, seen = ranks._context, {}
    print(f"first forked group (starts the server): {timed(forked, 2, idle, seen):.1f} s")
    print("| group | spawned | forked | ratio |\n|---|---:|---:|---:|")
    cases = [(int(n), idle) for n in args.ranks.split(",")] + [(4, layout)]
    for n, fn in cases:
        for _ in range(args.repeats):
            s, f = timed(spawned, n, fn, seen), timed(forked, n, fn, seen)
            print(f"| {n} ranks, {fn.__name__} | {s:.1f} s | {f:.1f} s | {f / s:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
