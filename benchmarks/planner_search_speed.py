"""CPU time of the layout search alone: Llama 3 405B on 8,192 H100s (issue 41's and 53's figure).

    PYTHONPATH=src .venv/bin/python benchmarks/planner_search_speed.py [--runs 3] [--profile 25]

Each run is a fresh process, so the planner's caches start cold, as in one `fivefold plan`. The
config is built as `fivefold plan --model.preset llama3-405b --train.dtype bf16 --train.seq_len
8192 --train.global_batch 2048 --cluster.gpu h100 --cluster.gpus 8192` builds it (the command
line's own parsing); `time.process_time()` is taken around `plan.search.search` only, not the
imports of Python, the model family and torch. --profile N prints cProfile's N costliest calls
(cumulative) of one run instead.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import time

ARGV = ["--model.preset", "llama3-405b", "--train.dtype", "bf16", "--train.seq_len", "8192",
        "--train.global_batch", "2048", "--cluster.gpu", "h100", "--cluster.gpus", "8192", "--json"]


def one_run(profile: int) -> None:
    """Run the command line in this process with search() timed (and profiled if asked)."""
    import fivefold.plan.cli as cli

    real = cli.search
    seen = {}

    def timed(*args, **kwargs):
        if profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            result = prof.runcall(real, *args, **kwargs)
            pstats.Stats(prof, stream=sys.stderr).sort_stats(os.environ.get("SORT", "cumulative")).print_stats(profile)
            return result
        start = time.process_time()
        result = real(*args, **kwargs)
        seen["cpu_s"] = time.process_time() - start
        seen["fitting"] = len(result.ranked)
        seen["evaluated"] = result.evaluated
        return result

    cli.search = timed
    with contextlib.redirect_stdout(io.StringIO()):
        rc = cli.run_plan(ARGV)
    if rc:
        raise SystemExit(rc)
    if not profile:
        print(f"{seen['cpu_s']:.3f} {seen['fitting']} {seen['evaluated']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, help="print the N costliest calls of one run")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child's run
    args = ap.parse_args()
    if args.one or args.profile:
        one_run(args.profile)
        return 0
    times = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, __file__, "--one"], check=True, capture_output=True, text=True)
        cpu_s, fitting, evaluated = out.stdout.split()
        times.append(float(cpu_s))
        print(f"search() {float(cpu_s):.2f} CPU s ({fitting} layouts fit of {evaluated} sized)", flush=True)
    print(f"runs: {', '.join(f'{t:.2f}' for t in times)}; min {min(times):.2f}, max {max(times):.2f} CPU s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
