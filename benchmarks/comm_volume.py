"""Measured communication per step (the ledger in metrics.jsonl) against the textbook volumes.

    python benchmarks/comm_volume.py            # ~2 minutes on 2 CPU cores

For each layout it runs `fivefold train` for a few steps on local CPU ranks, reads `comm_bytes` of
the last step from metrics.jsonl, and divides by the textbook bytes per rank (shared/data/README.md):
- dp, zero 0/1/2: ring all-reduce of the fp32 gradients, 2(N-1)/N · 4 · params
  (zero 1/2 do it as reduce-scatter + all-gather: the same bytes);
- dp, zero 3: 1.5x that (all-gather in forward, again in backward, reduce-scatter of gradients);
- tp with sp: 8·b·s·h·(t-1)/t elements per layer per micro-batch, plus 4·b·s·h·(t-1)/t for the
  vocab-parallel embedding (reduce-scatter forward, all-gather backward) and output layer (all-gather
  forward, reduce-scatter backward), which the per-layer formula leaves out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from fivefold.configure import load_config
from fivefold.models import build_model

COMMON = ["--train.steps", "3", "--train.seq_len", "128", "--train.global_batch", "8", "--log.every", "100",
          "--train.eval_every", "0"]
LAYOUTS = {
    "dp2 zero0": (2, ["--parallel.dp", "2", "--parallel.zero", "0"]),
    "dp2 zero1": (2, ["--parallel.dp", "2", "--parallel.zero", "1"]),
    "dp2 zero2": (2, ["--parallel.dp", "2", "--parallel.zero", "2"]),
    "dp2 zero3": (2, ["--parallel.dp", "2", "--parallel.zero", "3"]),
    "dp4 zero0": (4, ["--parallel.dp", "4", "--parallel.zero", "0"]),
    "tp2 sp": (2, ["--parallel.tp", "2"]),
    "tp4 sp": (4, ["--parallel.tp", "4", "--model.n_kv_heads", "4"]),
}


def measured(nproc: int, args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "fivefold", "train", "--nproc", str(nproc), *COMMON, *args,
               "--log.dir", run_dir]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        last = Path(run_dir, "metrics.jsonl").read_text().strip().splitlines()[-1]
        return json.loads(last)["comm_bytes"]


def textbook(name: str, nproc: int, args: list[str]) -> tuple[str, float]:
    cfg = load_config(None, COMMON + args)
    params = sum(p.numel() for p in build_model(cfg.model, 0).parameters())
    allreduce = 2 * (nproc - 1) / nproc * 4 * params
    if "zero3" in name:
        return "dp", 1.5 * allreduce
    if name.startswith("dp"):
        return "dp", allreduce
    t, m = nproc, cfg.model
    per_rank_batch = cfg.train.global_batch  # tp ranks all see the whole batch
    unit = per_rank_batch * cfg.train.seq_len * m.dim * (t - 1) / t
    return "tp", 4 * unit * (8 * m.n_layers + 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    print("| layout | dimension | measured bytes/rank/step | textbook | ratio | other dims measured |")
    print("|---|---|---|---|---|---|")
    for name, (nproc, args) in LAYOUTS.items():
        comm = measured(nproc, args)
        dim, expected = textbook(name, nproc, args)
        others = {k: v for k, v in comm.items() if k != dim}
        print(f"| {name} | {dim} | {comm.get(dim, 0):,} | {expected:,.0f} | {comm.get(dim, 0) / expected:.3f} | "
              f"{others} |", flush=True)


if __name__ == "__main__":
    main()
