"""Fit the kernel-stack constants of plan/fitted.py on a declared set of published runs, report the
error on the runs left out, and write the constants with their provenance.

    PYTHONPATH=src .venv/bin/python benchmarks/calibrate_stacks.py [--dry-run]   # ~1 minute, 1 core

It fits two constants of the `megatron` profile: matmul_rate (Transformer Engine's GEMM rate over
the torch stacks' fitted H100 efficiency) on the bf16 rows, then float8_linear_speedup (TE's FP8
GEMM rate over its bf16 one, before the fused casts) on the FP8 twins. Everything else in that
profile is a mechanism with a stated source (plan/hardware.py MEGATRON_RUNTIME).

The split (FIT and HELD_OUT below, committed here): NVIDIA's DGX Cloud NeMo runs
(../shared/data/published_runs_h100_b200.csv, group dense-bf16, `--framework megatron`) at each
model's smallest published scale are fitted; the same models at their largest scale are held
out. Leave-one-model-out: for each model, the constant fitted on the other models' smallest-scale
rows predicts both of its rows. The profile's printed band (Runtime.tokens_per_sec_error) is the
median and 90th percentile of those leave-one-model-out errors, never the in-sample ones.
The FP8 twins (five models, one row each, headline=no in the CSV) are fitted together and
reported leave-one-out (each twin predicted by the speed-up fitted on the other four).
Nothing else in the CSV (Meta's torchtitan rows, the MoE rows) is fitted.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import io
import json
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CSV = REPO / ".." / "shared" / "data" / "published_runs_h100_b200.csv"
TOOL_DIR = REPO / ".." / "shared" / "tools"
FITTED = REPO / "src" / "fivefold" / "plan" / "fitted.py"

MODELS = ("llama3.1-8b", "llama3.1-70b", "llama3.1-405b", "gpt3-175b", "nemotron4-340b", "nemotron4-15b")
FIT = ("dgxc-llama3.1-8b-8gpu", "dgxc-llama3.1-70b-64gpu", "dgxc-llama3.1-405b-576gpu",
       "dgxc-gpt3-175b-128gpu", "dgxc-nemotron4-340b-128gpu", "dgxc-nemotron4-15b-16gpu")
HELD_OUT = ("dgxc-llama3.1-8b-128gpu", "dgxc-llama3.1-70b-2048gpu", "dgxc-llama3.1-405b-2304gpu",
            "dgxc-gpt3-175b-2048gpu", "dgxc-nemotron4-340b-2048gpu", "dgxc-nemotron4-15b-2048gpu")
FP8_TWINS = ("dgxc-llama3.1-8b-8gpu-fp8", "dgxc-llama3.1-70b-64gpu-fp8", "dgxc-llama3.1-405b-576gpu-fp8",
             "dgxc-gpt3-175b-128gpu-fp8", "dgxc-nemotron4-340b-128gpu-fp8")
GRID = [0.90 + 0.005 * i for i in range(101)]  # 0.90 .. 1.40
# Up to 1.8: what a large FP8 GEMM reaches over bf16 in published cuBLAS sweeps on H100 (~1,350
# against ~750 TFLOP/s), below the 2x of the peaks. The fit reaches this bound (the large models'
# twins want more, the 8B and 70B less): a mechanism is missing, not a constant (RESULTS.md).
FP8_GRID = [1.0 + 0.01 * i for i in range(81)]  # 1.0 .. 1.8


def _model(name: str) -> str:
    return next(m for m in MODELS if m in name)


class Rows:
    """The CSV's rows as the planner parses them, each evaluated in process (the command line's
    own parsing, once per row; then only the profile's constant varies)."""

    def __init__(self, path: Path):
        sys.path.insert(0, str(TOOL_DIR))
        from published_runs import planner_args  # the published-run tool's own mapping of a row

        import fivefold.plan.cli as cli
        self.rows = {r["name"]: r for r in csv.DictReader(path.open(newline=""))}
        self.calls = {}
        real = cli.estimate
        for name in FIT + HELD_OUT + FP8_TWINS:
            seen = []
            cli.estimate = lambda *a, **k: seen.append(a) or real(*a, **k)  # noqa: E731
            try:
                with contextlib.redirect_stdout(io.StringIO()) as out:
                    cli.run_plan(planner_args("fivefold", self.rows[name])[2:])
            finally:
                cli.estimate = real
            self.calls[name] = seen[0]
            self.rows[name]["_json"] = json.loads(out.getvalue())["candidates"][0]

    def error(self, name: str, rate: float, fp8: float | None = None) -> float:
        """Predicted / published tokens/s per GPU - 1 with the profile's matmul_rate = rate (and
        float8_linear_speedup = fp8 where given)."""
        from published_runs import published_tokens_per_gpu

        from fivefold.plan.estimate import estimate
        workload, layout, hw, runtime = self.calls[name]
        runtime = dataclasses.replace(runtime, matmul_rate=rate)
        if fp8 is not None:
            runtime = dataclasses.replace(runtime, float8_linear_speedup=fp8)
        est = estimate(workload, layout, hw, runtime)
        flops_per_token = est.mfu * hw.peak_flops / est.tokens_per_sec_per_gpu
        return est.tokens_per_sec_per_gpu / published_tokens_per_gpu(self.rows[name], flops_per_token) - 1


def fit(rows: Rows, names) -> float:
    """The rate minimising the mean |log(predicted / published)| over `names` (a grid: the
    objective is flat between rows, and the grid's step, 0.5%, is below the data's noise)."""
    return min(GRID, key=lambda r: sum(abs(math.log1p(rows.error(n, r))) for n in names))


def fit_fp8(rows: Rows, rate: float, names) -> float:
    """The FP8 speed-up minimising the mean |log error| over the FP8 twins `names`."""
    return min(FP8_GRID, key=lambda x: sum(abs(math.log1p(rows.error(n, rate, x))) for n in names))


def quantile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def write(rate: float, band: tuple[float, float], fp8: float, text: str) -> None:
    """Replace this script's block of plan/fitted.py (between its markers; calibrate_time.py owns another)."""
    begin, end = "# --- written by benchmarks/calibrate_stacks.py\n", "# --- end of benchmarks/calibrate_stacks.py\n"
    src = FITTED.read_text()
    start, stop = src.index(begin) + len(begin), src.index(end)
    block = ("# Megatron-core / Transformer Engine's large-GEMM rate over the torch stacks' on the same GPU\n"
             "# (Runtime.matmul_rate of the `megatron` profile): the share of H100's fitted matmul_efficiency\n"
             "# that TE's cuBLASLt GEMMs (tuned algorithms, fused epilogues, no framework dispatch between them)\n"
             "# reach more in a NeMo step.\n"
             f"MEGATRON_MATMUL_RATE = {rate:.3f}\n"
             f"# The profile's band: median and 90th percentile of |tokens/s error| leave-one-model-out.\n"
             f"MEGATRON_BAND = ({band[0]:.3f}, {band[1]:.3f})\n"
             f"# Transformer Engine's FP8 GEMM rate over its bf16 one, large GEMMs, casts fused (1 byte\n"
             f"# per operand element: Runtime.float8_cast_bytes_per_element).\n"
             f"MEGATRON_FP8_SPEEDUP = {fp8:.2f}\n\nFIT_SETS = {{\n{text}}}\n")
    FITTED.write_text(src[:start] + block + src[stop:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print, do not write plan/fitted.py")
    args = ap.parse_args(argv)
    if not CSV.is_file():
        print(f"{CSV} is not there (the published runs live in ../shared/data)", file=sys.stderr)
        return 2
    rows = Rows(CSV)
    rate = fit(rows, FIT)
    print(f"megatron matmul_rate fitted on {len(FIT)} rows: {rate:.3f}")
    print(f"{'row':34s} {'in fit':>7s} {'held':>7s} {'LOMO':>7s}")
    lomo = {}
    for model in MODELS:
        others = [n for n in FIT if _model(n) != model]
        r = fit(rows, others)
        for n in FIT + HELD_OUT:
            if _model(n) == model:
                lomo[n] = (r, rows.error(n, r))
    for n in FIT + HELD_OUT:
        err = rows.error(n, rate)
        print(f"{n:34s} {err if n in FIT else float('nan'):+7.1%} {err if n in HELD_OUT else float('nan'):+7.1%} "
              f"{lomo[n][1]:+7.1%}  (rate {lomo[n][0]:.3f} without {_model(n)})")
    fit_err = [abs(rows.error(n, rate)) for n in FIT]
    held_err = [abs(rows.error(n, rate)) for n in HELD_OUT]
    out_err = [abs(e) for _, e in lomo.values()]
    band = (statistics.median(out_err), quantile(out_err, 0.9))
    print(f"median |error|: fitted rows {statistics.median(fit_err):.1%}, held-out scale "
          f"{statistics.median(held_err):.1%}, leave-one-model-out {band[0]:.1%} (p90 {band[1]:.1%})")
    fp8 = fit_fp8(rows, rate, FP8_TWINS)
    print(f"\nmegatron float8_linear_speedup fitted on the {len(FP8_TWINS)} FP8 twins: {fp8:.2f}")
    fp8_out = []
    for n in FP8_TWINS:
        alone = fit_fp8(rows, rate, [m for m in FP8_TWINS if m != n])
        fp8_out.append(abs(rows.error(n, rate, alone)))
        print(f"{n:34s} in fit {rows.error(n, rate, fp8):+7.1%}  left out {rows.error(n, rate, alone):+7.1%}"
              f"  (speed-up {alone:.2f} without it)")
    print(f"FP8 twins median |error|: in fit {statistics.median(abs(rows.error(n, rate, fp8)) for n in FP8_TWINS):.1%}"
          f", leave-one-out {statistics.median(fp8_out):.1%}")
    if args.dry_run:
        return 0
    text = (f'    "MEGATRON_MATMUL_RATE": "benchmarks/calibrate_stacks.py: fitted on {", ".join(FIT)} '
            f'(../shared/data/published_runs_h100_b200.csv); held out {", ".join(HELD_OUT)}: median '
            f'{statistics.median(held_err):.3f}",\n'
            f'    "MEGATRON_BAND": "leave-one-model-out over the 12 NeMo dense bf16 rows: median '
            f'{band[0]:.3f}, p90 {band[1]:.3f}",\n')
    bound = " at the grid's bound, cuBLAS's FP8/bf16 ratio (a mechanism is missing)" if fp8 >= FP8_GRID[-1] else ""
    text += (f'    "MEGATRON_FP8_SPEEDUP": "benchmarks/calibrate_stacks.py: fitted on {", ".join(FP8_TWINS)} '
             f'(with MEGATRON_MATMUL_RATE){bound}; leave-one-out median {statistics.median(fp8_out):.3f}",\n')
    write(rate, band, fp8, text)
    print(f"wrote {FITTED.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
