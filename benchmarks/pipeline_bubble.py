"""Pipeline bubble of every schedule: the formulas, the schedules' own action tables, and a
measured wall-clock run on CPU ranks.

    python benchmarks/pipeline_bubble.py            # tables only: a second
    python benchmarks/pipeline_bubble.py --measure  # + CPU runs at pp=2 (~3 minutes on 2 cores)

"table" replays the action lists that torch.distributed.pipelining plans for each rank (the same
lists it executes) with forward = 1, backward = 2 (zero-bubble schedules: input- and weight-gradient
halves of 1 each) and reports the idle share of all ranks. "measured" is `bubble_fraction` from
metrics.jsonl: 1 - (time inside stage forward/backward actions) / step time, averaged over pp ranks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from fivefold.parallel.pipeline.schedule_table import schedule_bubble

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb", 2), ("zbv", 2), ("dualpipev", 2)]


def formula(schedule: str, p: int, v: int, m: int) -> str:
    if schedule in ("gpipe", "1f1b"):
        return f"{(p - 1) / (m + p - 1):.3f}"
    if schedule == "interleaved_1f1b":
        return f"{(p - 1) / (v * m + p - 1):.3f}"
    if schedule == "zb":
        return f"≈{(p - 1) / (v * m + p - 1) / 3:.3f}"  # about a third of the interleaved bubble
    return "≈0"  # ZB-V / DualPipeV: close to zero in steady state


def measured(schedule: str, v: int, m: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "fivefold", "train", "--nproc", "2", "--parallel.pp", "2",
               "--parallel.pp_schedule", schedule, "--parallel.pp_virtual", str(v),
               "--model.dim", "256", "--model.ffn_dim", "768", "--model.n_layers", "8",
               "--train.seq_len", "128", "--train.global_batch", str(m), "--train.micro_batch", "1",
               "--train.steps", "5", "--log.dir", run_dir, "--log.progress", "false"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        records = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
        steady = records[1:]  # the first step includes the stages' shape inference
        return sum(r["bubble_fraction"] for r in steady) / len(steady)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="also run pp=2 on local CPU ranks")
    args = parser.parse_args()
    print("| schedule | pp | stages/rank | micro-batches | formula | table | measured (CPU) |")
    print("|---|---|---|---|---|---|---|")
    for schedule, v in SCHEDULES:
        for p in (2, 4):
            for m in (4, 8, 16):
                if schedule in ("1f1b", "dualpipev") and m < p * v:
                    continue  # the schedule needs at least as many micro-batches as stages
                table = schedule_bubble(schedule, p, v, m)
                run = f"{measured(schedule, v, m):.3f}" if args.measure and p == 2 else ""
                print(f"| {schedule} | {p} | {v} | {m} | {formula(schedule, p, v, m)} | {table:.3f} | {run} |",
                      flush=True)


if __name__ == "__main__":
    main()
