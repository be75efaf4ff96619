"""Parallel efficiency on CPU: tokens/s for 1, 2 and 4 processes under dp, tp, pp and cp, with the
communication bytes each dimension sent (the ledger's `comm_bytes` in metrics.jsonl) beside it.

    python benchmarks/scaling.py [--sizes 2,4] [--dims dp,tp,pp,cp] [--steps 6] [--warmup 2]
        [--threads 1] [--out runs/scaling]

Every run is `python -m fivefold train --nproc N ...` with `OMP_NUM_THREADS=--threads`, the same
model, global batch and sequence length (the math is the same in every layout), one dimension at
a time. tokens/s is the median over steps after the warm-up of the trainer's world tokens/s.
Efficiency = tokens/s ÷ (tokens/s of 1 process × min(N, usable cores ÷ threads)): on a machine
with fewer cores than processes, ideal is the core count, not N. On a machine shared with other
jobs the wall clock measures the other jobs; `--cpu-work` adds the CPU seconds per step of all ranks
together against 1 process, which shows work added by a layout (copies, dispatch) but not waiting.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Big enough that the matmuls dominate a step on a CPU core; divisible by 4 in every dimension.
MODEL = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1024, vocab_size=256)
TRAIN = dict(seq_len=256, global_batch=8, eval_every=0, warmup=2, schedule="constant")


def run(layout: dict, n: int, steps: int, threads: int, out: Path, extra: list[str]) -> dict:
    run_dir = out / ("single" if n == 1 else "_".join(f"{k}{v}" for k, v in layout.items()))
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    args = [sys.executable, "-m", "fivefold", "train", "--nproc", str(n), "--log.dir", str(run_dir),
            "--log.progress", "false", "--train.steps", str(steps)]
    for section, values in (("model", MODEL), ("train", TRAIN), ("parallel", layout)):
        for key, value in values.items():
            args += [f"--{section}.{key}", str(value)]
    args += extra
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(args)}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"records": records, "wall_s": time.perf_counter() - start, "command": " ".join(args[1:]),
            "cpu_s": cpu_s}


def cpu_per_step(layout: dict, n: int, steps: int, threads: int, out: Path, extra: list[str],
                 full_run_cpu_s: float) -> float:
    """CPU seconds per step, all ranks together: a 2-step run's CPU time removes start-up."""
    short = run(layout, n, 2, threads, out, extra)
    return (full_run_cpu_s - short["cpu_s"]) / (steps - 2)


def summarize(records: list[dict], warmup: int) -> dict:
    after = records[warmup:]
    measured = [r["comm_bytes"] for r in after if "comm_bytes" in r]  # the ledger's steps only
    comm: dict[str, float] = {}
    for ledger in measured:
        for dim, nbytes in ledger.items():
            comm[dim] = comm.get(dim, 0) + nbytes / len(measured)
    return {"tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in after),
            "step_time_s": statistics.median(r["step_time_s"] for r in after),
            "comm_bytes": comm, "loss_last": records[-1]["loss"]}


def fmt_bytes(comm: dict[str, float]) -> str:
    if not comm:
        return "-"
    return ", ".join(f"{dim} {nbytes / 2**20:.1f} MiB" for dim, nbytes in sorted(comm.items()))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="2,4")
    p.add_argument("--dims", default="dp,tp,pp,cp")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    p.add_argument("--cores", type=int, default=os.cpu_count(), help="cores the ideal assumes")
    p.add_argument("--out", default="runs/scaling")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--cpu-work", action="store_true",
                   help="also run each layout for 2 steps: (CPU s of all ranks, N steps - 2 steps) / (N - 2) "
                        "is the CPU work per step, blind to waiting (for machines shared with other jobs)")
    p.add_argument("extra", nargs="*", help="more overrides, e.g. --parallel.zero 1 (after --)")
    args = p.parse_args(argv)
    out = (ROOT / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    base = run({}, 1, args.steps, args.threads, out, args.extra)
    one = summarize(base["records"], args.warmup)
    rows = [{"layout": "1 process", "n": 1, **one, "efficiency": 1.0, "efficiency_n": 1.0,
             "command": base["command"], "cpu_s": base["cpu_s"], "wall_s": base["wall_s"]}]
    if args.cpu_work:
        rows[0]["cpu_step_s"] = cpu_per_step({}, 1, args.steps, args.threads, out, args.extra, base["cpu_s"])
    print(f"1 process: {one['tokens_per_sec']:.0f} tok/s ({base['wall_s']:.0f} s)", flush=True)
    for dim in args.dims.split(","):
        for n in map(int, args.sizes.split(",")):
            layout = {dim: n}
            extra = list(args.extra)
            if dim == "pp":
                extra += ["--train.micro_batch", "1"]  # 8 micro-batches in flight
            got = run(layout, n, args.steps, args.threads, out, extra)
            s = summarize(got["records"], args.warmup)
            ideal = one["tokens_per_sec"] * min(n, max(1, args.cores // args.threads))
            rows.append({"layout": f"{dim}={n}", "n": n, **s, "efficiency": s["tokens_per_sec"] / ideal,
                         "efficiency_n": s["tokens_per_sec"] / (one["tokens_per_sec"] * n),
                         "command": got["command"], "cpu_s": got["cpu_s"], "wall_s": got["wall_s"],
                         "loss_matches": abs(s["loss_last"] - one["loss_last"]) <= 1e-4 * abs(one["loss_last"])})
            if args.cpu_work:
                rows[-1]["cpu_step_s"] = cpu_per_step(layout, n, args.steps, args.threads, out, extra, got["cpu_s"])
            print(f"{dim}={n}: {s['tokens_per_sec']:.0f} tok/s, efficiency {rows[-1]['efficiency']:.2f}, "
                  f"comm/step {fmt_bytes(s['comm_bytes'])} ({got['wall_s']:.0f} s)", flush=True)
    print(f"\nmodel {MODEL}, train {TRAIN}, {args.threads} thread(s) per process, ideal = min(N, "
          f"{args.cores} cores / {args.threads} threads) x 1-process tokens/s\n")
    print("| layout | tokens/s | step (s) | efficiency vs min(N, cores) | vs N | comm bytes / step / rank "
          "(ledger) | CPU s, all ranks, whole run | same loss |")
    print("|---|---:|---:|---:|---:|---|---:|---|")
    for r in rows:
        same = "ref" if r["n"] == 1 else ("yes" if r["loss_matches"] else "NO")
        print(f"| {r['layout']} | {r['tokens_per_sec']:.0f} | {r['step_time_s']:.3f} | {r['efficiency']:.2f} "
              f"| {r['efficiency_n']:.2f} | {fmt_bytes(r['comm_bytes'])} | {r['cpu_s']:.0f} | {same} |")
    if args.cpu_work:
        print("\n| layout | CPU s / step, all ranks | x 1 process (1.00 = no extra work) |\n|---|---:|---:|")
        for r in rows:
            print(f"| {r['layout']} | {r['cpu_step_s']:.3f} | {r['cpu_step_s'] / rows[0]['cpu_step_s']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
