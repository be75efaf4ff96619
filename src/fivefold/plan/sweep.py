"""`fivefold plan ... --sweep K`: run the planner's top K layouts for a few steps on the machine at
hand and set what they measure beside what was predicted (the seed's last step: empirical
validation). Each layout runs as its own `fivefold train` job on local ranks; nothing here
imports torch."""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from fivefold.config import Config, to_toml
from fivefold.plan.layout import config_with_layout

SWEEP_STEPS = 6  # the first step (start-up, pipeline shape inference) is left out of the median


def measure(cfg: Config, layout) -> dict:
    """Train `cfg` under `layout` for a few steps; tokens/s per rank (median) and peak memory."""
    cfg = config_with_layout(cfg, layout)
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, steps=SWEEP_STEPS, eval_every=0),
            log=dataclasses.replace(cfg.log, dir=run_dir, progress=False, tensorboard=False))
        path = Path(run_dir) / "layout.toml"
        path.write_text(to_toml(cfg))
        done = subprocess.run([sys.executable, "-m", "fivefold", "train", str(path),
                               "--nproc", str(layout.world_size)], capture_output=True, text=True)
        if done.returncode != 0:
            return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steady = records[1:] or records
    return {"tokens_per_sec_per_gpu": statistics.median(r["tokens_per_sec"] for r in steady) / layout.world_size,
            "peak_mem_bytes": max(r["peak_mem_bytes"] or 0 for r in records)}


def sweep_table(cfg: Config, candidates: list) -> str:
    rows = ["| # | layout | predicted tok/s/GPU | measured tok/s/GPU | measured / predicted | "
            "predicted GB | measured peak GB |", "|---|---|---|---|---|---|---|"]
    for i, est in enumerate(candidates, 1):
        got = measure(cfg, est.layout)
        if "error" in got:
            rows.append(f"| {i} | {est.layout.short()} | {est.tokens_per_sec_per_gpu:,.0f} | failed: "
                        f"{got['error']} | | | |")
            continue
        ratio = got["tokens_per_sec_per_gpu"] / est.tokens_per_sec_per_gpu
        rows.append(f"| {i} | {est.layout.short()} | {est.tokens_per_sec_per_gpu:,.0f} | "
                    f"{got['tokens_per_sec_per_gpu']:,.0f} | {ratio:.2f} | {est.memory.total / 1e9:.2f} | "
                    f"{got['peak_mem_bytes'] / 1e9:.2f} |")
    return "\n".join(rows)
