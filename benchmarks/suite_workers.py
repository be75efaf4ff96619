"""What a second pytest worker would buy the suite: the same test files run with one worker (`-n 0`)
and with two (`-n 2 --dist loadfile`: whole files per worker, so a file's group of ranks stays in
one), alternating so that both see the same machine. Needs pytest-xdist (in the [test] extra; the
README's test command runs two workers). Reports each run's wall time and the CPU time of pytest
and everything it started (ranks, CLI processes), and the ratio of the medians.

    OMP_NUM_THREADS=1 python benchmarks/suite_workers.py [FILES ...] [--repeats 2]

The default files mix single-process work (the planner, configs, Hugging Face parity) with groups
of ranks (tensor and pipeline layouts), as the suite does.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILES = ["tests/test_tensor_parallel.py", "tests/test_pipeline.py", "tests/test_plan_at_scale.py",
                 "tests/test_plan_cli.py", "tests/test_config.py", "tests/test_hf.py", "tests/test_data.py"]
WAYS = {"one worker": ["-n", "0"], "two workers": ["-n", "2", "--dist", "loadfile"]}


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(files: list[str], args: list[str]) -> tuple[float, float, str]:
    cpu_before, start = children_cpu_s(), time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, *files],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - start
    summary = [line for line in done.stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
    if done.returncode:
        sys.exit(f"pytest {' '.join(args)} failed:\n{done.stdout[-3000:]}")
    return wall, children_cpu_s() - cpu_before, summary[0]


def main() -> None:
    import importlib.util

    if importlib.util.find_spec("xdist") is None:
        sys.exit("benchmarks/suite_workers.py compares pytest-xdist's workers: pip install pytest-xdist")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", default=DEFAULT_FILES)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    walls: dict[str, list[float]] = {way: [] for way in WAYS}
    for round_ in range(args.repeats):
        for way, extra in WAYS.items():
            wall, cpu, summary = run(args.files, extra)
            walls[way].append(wall)
            print(f"round {round_ + 1} {way:>11}: {wall:6.1f} s wall, {cpu:6.1f} s CPU ({summary})", flush=True)
    one, two = (statistics.median(walls[way]) for way in WAYS)
    print(f"median wall: one worker {one:.1f} s, two workers {two:.1f} s: {two / one:.2f}x")


if __name__ == "__main__":
    main()
