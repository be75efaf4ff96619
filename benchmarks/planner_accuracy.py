"""How well does the planner predict real training runs?

Reads the Ultra-Scale Playbook's published runs (Hugging Face, 2025: nanotron, 1B/3B/8B Llama-style
models on 1-64 nodes of 8 H100s) and reports, for the runs that ran:
  - median relative error of tokens/s per GPU and of peak memory,
  - the share of runs whose fit / out-of-memory outcome the planner predicts right (all rows),
  - Spearman rank correlation of tokens/s within each (model, nodes) group.

Usage (from the repository root):
  PYTHONPATH=src .venv/bin/python benchmarks/planner_accuracy.py [--csv FILE ...] [--json OUT.json]
      [--worst N]
Without --csv it reads both calibration files: ../shared/data/playbook_runs_dev.csv (nanotron
profile) and ../shared/data/torchtitan_h100_2024.csv (fivefold's eager / compiled profiles;
torchtitan's FP8 linears and its FSDP-under-PP policy are the only torchtitan-specific changes).

The model shapes and training setup are the Playbook's (see ../shared/data/README.md): sequence
4096, global batch 256, vocabulary 131,072, full multi-head attention, bf16 compute with fp32
gradient accumulation buffers, FlashAttention, TP with sequence parallelism, 1F1B pipeline.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from fivefold.config import ModelConfig
from fivefold.plan.estimate import estimate
from fivefold.plan.hardware import hardware_for
from fivefold.plan.speed.frameworks import FIVEFOLD_EAGER, NANOTRON_RUNTIME
from fivefold.plan.layout import Layout
from fivefold.plan.model_stats import model_stats
from fivefold.plan.workload import PRECISIONS, Workload

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CSV = REPO / ".." / "shared" / "data" / "playbook_runs_dev.csv"

# The Playbook's three models (data README table): MHA, vocab 131,072, tied below ffn 10,000.
SHAPES = {
    "1B": dict(dim=2048, n_layers=16, n_heads=32, ffn_dim=8192),
    "3B": dict(dim=3072, n_layers=28, n_heads=32, ffn_dim=8192),
    "8B": dict(dim=4096, n_layers=32, n_heads=32, ffn_dim=14336),
}
SEQ_LEN, GLOBAL_BATCH, VOCAB = 4096, 256, 131072
# Peak memory is reported in GiB-sized "GB" by torch.cuda (bytes / 2**30), and counts what
# PyTorch's allocator handed out: compared with the planner's MemoryBreakdown.allocated (its total
# less the CUDA context and NCCL's buffers, which the fit check against the device does count).
MEM_UNIT = 2 ** 30


def workload_for(name: str) -> Workload:
    shape = SHAPES[name]
    model = ModelConfig(preset=name, n_kv_heads=shape["n_heads"], vocab_size=VOCAB,
                        tie_embeddings=shape["ffn_dim"] < 10_000, max_seq_len=SEQ_LEN, **shape)
    return Workload(stats=model_stats(model), seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH,
                    precision=PRECISIONS["bf16_fp32_accum"], order=("pp", "dp", "cp", "tp"))


def nanotron_pp_layers(name: str, pp: int) -> str | None:
    """Layers per pipeline rank as nanotron places them, or None when a rank gets nothing.

    nanotron (its build_model) walks its pipeline blocks (embedding, decoder layers,
    final norm, lm_head, fp32 cast, loss) in order with their costs (a layer 4h^2 + 3h*ffn, the
    lm_head vocab*h, the rest 0) and moves to the next rank once the cumulative cost passes
    (rank+1)/pp of the total. Early ranks get the extra layers; the last ones may get none."""
    shape = SHAPES[name]
    h, n_layers = shape["dim"], shape["n_layers"]
    layer, head = 4 * h * h + 3 * shape["ffn_dim"] * h, VOCAB * h
    costs = [0] + [layer] * n_layers + [0, head, 0, 0]
    total = sum(costs)
    owner, rank, cumulative = [], 0, 0
    for cost in costs:
        cumulative += cost
        owner.append(rank)
        if cumulative > total * (rank + 1) / pp:
            rank += 1
    if len(set(owner)) < pp:
        return None  # a pipeline rank without any block: nanotron cannot run it
    return ",".join(str(sum(1 for i in range(1, n_layers + 1) if owner[i] == r)) for r in range(pp))


def layout_for(row: dict) -> Layout | None:
    pp = int(row["pp"])
    split = nanotron_pp_layers(row["model"], pp) if pp > 1 else ""
    if split is None:
        return None
    return Layout(dp=int(row["dp"]), zero=int(row["zero"]), tp=int(row["tp"]), pp=pp,
                  mbs=int(row["mbs"]), recompute="none", pp_schedule="1f1b", pp_layers=split)


def playbook_hardware():
    """The Playbook's cluster: H100 nodes on a fabric whose bandwidth per GPU falls with the nodes
    a collective spans (its runs show it; Hardware.fabric = 'tapered')."""
    return dataclasses.replace(hardware_for("h100"), fabric="tapered")


def predict(rows: list[dict], runtime=NANOTRON_RUNTIME, hw=None) -> list[dict]:
    hw = hw or playbook_hardware()
    workloads = {name: workload_for(name) for name in SHAPES}
    out = []
    for row in rows:
        work, layout = workloads[row["model"]], layout_for(row)
        if layout is None:  # predicted not to run
            out.append({**row, "pred_tok_s": 0.0, "pred_mem_gb": 0.0, "pred_fits": False,
                        "pred_parts": {}})
            continue
        est = estimate(work, layout, hw, runtime)
        out.append({**row, "pred_tok_s": est.tokens_per_sec_per_gpu,
                    "pred_mem_gb": est.memory.allocated / MEM_UNIT, "pred_fits": est.fits,
                    "pred_parts": est.time_parts})
    return out


# ------------------------------------------------------------------ torchtitan (PyTorch-native)

TORCHTITAN_CSV = REPO / ".." / "shared" / "data" / "torchtitan_h100_2024.csv"
# Llama 3.1 shapes (Meta's model cards): GQA with 8 KV heads, vocabulary 128,256, untied.
TITAN_SHAPES = {
    "llama3.1-8b": dict(dim=4096, n_layers=32, n_heads=32, ffn_dim=14336),
    "llama3.1-70b": dict(dim=8192, n_layers=80, n_heads=64, ffn_dim=28672),
    "llama3.1-405b": dict(dim=16384, n_layers=126, n_heads=128, ffn_dim=53248),
}
# Grand Teton hosts: H100 96 GB HBM2e at 500 W (data README). MFU is quoted against the SXM peak,
# so the peak stays 989 TFLOP/s; the power cap lowers the clock the matmuls run at.
# POWER_DERATE: sustained tensor-core throughput at 500 W over 700 W, from H100 power/clock curves
# (~1.98 GHz boost falling to ~1.6 GHz under a 500 W cap on dense GEMMs): an assumption, not fitted.
POWER_DERATE = 0.82


def titan_hardware():
    h100 = hardware_for("h100")
    return dataclasses.replace(h100, memory_bytes=96 * 2 ** 30,
                               matmul_efficiency=h100.matmul_efficiency * POWER_DERATE)


def titan_workload(row: dict) -> Workload:
    shape = TITAN_SHAPES[row["model"]]
    seq = int(row["seq_len"])
    model = ModelConfig(preset=row["model"], n_kv_heads=8, vocab_size=128256, tie_embeddings=False,
                        max_seq_len=seq, **shape)
    # FSDP2 with bf16 compute and fp32 gradient reduction: fivefold's bf16 recipe.
    return Workload(stats=model_stats(model), seq_len=seq, global_batch=int(row["global_batch"]),
                    precision=PRECISIONS["bf16"], order=("pp", "dp", "cp", "tp"),
                    fp8="tensorwise" if row["float8"] == "true" else "")


def titan_layout(row: dict) -> Layout:
    pp, local = int(row["pp"]), int(row["local_batch"])
    schedule = row["pp_schedule"] or "1f1b"
    # torchtitan splits a rank's batch into micro-batches of 1 sequence under a pipeline and runs
    # it whole otherwise (no gradient accumulation in these tables).
    return Layout(dp=int(row["fsdp"]), zero=3, tp=int(row["tp"]), pp=pp, cp=int(row["cp"]),
                  mbs=1 if pp > 1 else local, recompute=row["recompute"], pp_schedule=schedule,
                  pp_virtual=2 if schedule == "interleaved_1f1b" else 1)


def titan_runtime(row: dict, eager=None, compiled=None):
    from fivefold.plan.speed.frameworks import FIVEFOLD_COMPILED, FIVEFOLD_EAGER
    runtime = (compiled or FIVEFOLD_COMPILED) if row["compile"] == "true" else (eager or FIVEFOLD_EAGER)
    # torchtitan's own behaviour where it differs from fivefold's: FP8 linears, FSDP blocks kept
    # gathered over a pipeline's micro-batches, and logits made whole for the loss (no fused
    # output layer). (The speed-up applies to the FP8 rows only: titan_workload marks them.)
    return dataclasses.replace(runtime, float8_linear_speedup=FLOAT8_LINEAR_SPEEDUP, fsdp_gather_once_in_pipeline=True,
                               fuses_output_loss=False)


# FP8 matmuls of nn.Linear after the scaling casts: the FP8 peak is 2x; torchtitan's 8B rows gain
# 1.28x end to end. Fitted with the fivefold profiles (calibrate_time.py, which varies this name);
# the profiles' own value, which `fivefold plan` applies to train.fp8 runs.
FLOAT8_LINEAR_SPEEDUP = FIVEFOLD_EAGER.float8_linear_speedup


def titan_predict(rows: list[dict], eager=None, compiled=None, hw=None) -> list[dict]:
    hw = hw or titan_hardware()
    out = []
    for row in rows:
        est = estimate(titan_workload(row), titan_layout(row), hw, titan_runtime(row, eager, compiled))
        out.append({**row, "status": "ok", "tok_s_gpu": row["tps_per_gpu"], "mem_gb": row["mem_gib"],
                    "pred_tok_s": est.tokens_per_sec_per_gpu, "pred_mem_gb": est.memory.allocated / MEM_UNIT,
                    "pred_fits": est.fits, "pred_parts": est.time_parts})
    return out


def titan_summarize(pred: list[dict]) -> dict:
    err = [abs(r["pred_tok_s"] / float(r["tok_s_gpu"]) - 1) for r in pred]
    mem = [abs(r["pred_mem_gb"] / float(r["mem_gb"]) - 1) for r in pred]
    bf16 = [e for e, r in zip(err, pred) if r["float8"] != "true"]
    return {"rows": len(pred), "median_tok_s_rel_error": statistics.median(err),
            "p90_tok_s_rel_error": _quantile(err, 0.9),
            "median_tok_s_rel_error_bf16": statistics.median(bf16) if bf16 else float("nan"),
            "median_mem_rel_error": statistics.median(mem),
            "fit_prediction_right": sum(r["pred_fits"] for r in pred) / len(pred),
            "spearman": spearman([float(r["tok_s_gpu"]) for r in pred], [r["pred_tok_s"] for r in pred])}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):  # average ranks over ties
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def summarize(pred: list[dict]) -> dict:
    ran = [r for r in pred if r["status"] == "ok"]
    tok_err = [abs(r["pred_tok_s"] - float(r["tok_s_gpu"])) / float(r["tok_s_gpu"]) for r in ran]
    mem_err = [abs(r["pred_mem_gb"] - float(r["mem_gb"])) / float(r["mem_gb"]) for r in ran]
    fit_right = [r["pred_fits"] == (r["status"] == "ok") for r in pred]
    groups = defaultdict(list)
    for r in ran:
        groups[(r["model"], int(r["nodes"]))].append(r)
    rho = {f"{m} x{n}": spearman([float(r["tok_s_gpu"]) for r in g], [r["pred_tok_s"] for r in g])
           for (m, n), g in sorted(groups.items()) if len(g) >= 3}
    by_scale = {}
    for label, keep in (("1-16 nodes", lambda n: n <= 16), ("32-64 nodes", lambda n: n >= 32)):
        errs = [e for e, r in zip(tok_err, ran) if keep(int(r["nodes"]))]
        by_scale[label] = {"runs": len(errs), "median_tok_s_rel_error": statistics.median(errs)}
    ok_pred_oom = sum(1 for r in pred if r["status"] == "ok" and not r["pred_fits"])
    fail_pred_fit = sum(1 for r in pred if r["status"] != "ok" and r["pred_fits"])
    return {
        "rows": len(pred), "ran": len(ran),
        "median_tok_s_rel_error": statistics.median(tok_err),
        "share_tok_s_within_15pct": sum(e <= 0.15 for e in tok_err) / len(tok_err),
        "p90_tok_s_rel_error": _quantile(tok_err, 0.9),
        "median_mem_rel_error": statistics.median(mem_err),
        "fit_prediction_right": sum(fit_right) / len(fit_right),
        "ran_but_predicted_oom": ok_pred_oom, "failed_but_predicted_fit": fail_pred_fit,
        "tok_s_error_by_scale": by_scale,
        "spearman_by_group": rho,
        "spearman_median": statistics.median(v for v in rho.values() if v == v),
    }


def _print_playbook(path: Path, rows: list[dict], worst: int) -> dict:
    pred = predict(rows)
    summary = summarize(pred)
    print(f"{path.name}: {summary['rows']} rows, {summary['ran']} ran (nanotron profile)")
    print(f"median |error| tokens/s/GPU : {summary['median_tok_s_rel_error']:.1%}"
          f"   (within 15%: {summary['share_tok_s_within_15pct']:.0%} of runs;"
          f" 90th percentile {summary['p90_tok_s_rel_error']:.0%})")
    for label, part in summary["tok_s_error_by_scale"].items():
        print(f"   on {label:11s}: {part['median_tok_s_rel_error']:.1%} over {part['runs']} runs")
    print(f"median |error| peak memory  : {summary['median_mem_rel_error']:.1%}")
    print(f"fit / OOM predicted right   : {summary['fit_prediction_right']:.1%}"
          f"   (ran but predicted OOM: {summary['ran_but_predicted_oom']}, "
          f"failed but predicted to fit: {summary['failed_but_predicted_fit']})")
    print(f"Spearman rho within (model, nodes), median {summary['spearman_median']:.2f}:")
    print("   " + "  ".join(f"{k} {v:.2f}" for k, v in summary["spearman_by_group"].items()))
    if worst:
        ran = [r for r in pred if r["status"] == "ok"]
        ran.sort(key=lambda r: -abs(r["pred_tok_s"] / float(r["tok_s_gpu"]) - 1))
        for r in ran[:worst]:
            print(f"  {r['model']} n{r['nodes']} dp{r['dp']} tp{r['tp']} pp{r['pp']} z{r['zero']} "
                  f"mbs{r['mbs']}: measured {float(r['tok_s_gpu']):.0f} predicted {r['pred_tok_s']:.0f}"
                  f" mem {r['mem_gb']}/{r['pred_mem_gb']:.1f}")
    return summary


def _print_titan(path: Path, rows: list[dict]) -> dict:
    pred = titan_predict(rows)
    summary = titan_summarize(pred)
    # The calibration fitted on the even rows (calibrate_time.py); the odd ones are held out.
    summary["held_out"] = titan_summarize(pred[1::2])
    summary["fitted_on"] = titan_summarize(pred[0::2])
    print(f"{path.name}: {summary['rows']} rows (fivefold eager / compiled profiles)")
    print(f"median |error| tokens/s/GPU : {summary['median_tok_s_rel_error']:.1%}"
          f"   (90th percentile {summary['p90_tok_s_rel_error']:.0%}; bf16 rows"
          f" {summary['median_tok_s_rel_error_bf16']:.1%})")
    print(f"   fitted rows (even) {summary['fitted_on']['median_tok_s_rel_error']:.1%},"
          f" held-out rows (odd) {summary['held_out']['median_tok_s_rel_error']:.1%}")
    print(f"median |error| peak memory  : {summary['median_mem_rel_error']:.1%}")
    print(f"fit / OOM predicted right   : {summary['fit_prediction_right']:.1%}")
    print(f"Spearman rho over all rows  : {summary['spearman']:.2f}")
    for r in pred:
        print(f"  t{r['table']} {r['model']} {r['gpus']} GPUs fsdp{r['fsdp']} tp{r['tp']} pp{r['pp']}"
              f" cp{r['cp']} seq{r['seq_len']} compile={r['compile']} fp8={r['float8']}:"
              f" measured {float(r['tok_s_gpu']):.0f} predicted {r['pred_tok_s']:.0f}")
    return summary


# ------------------------------------------------ published large runs, each with its framework

PUBLISHED_CSV = REPO / ".." / "shared" / "data" / "published_runs_dev.csv"
PUBLISHED_TOOL = REPO / ".." / "shared" / "tools" / "published_runs.py"
# The framework each published run was made with, by a word of its source, and the planner
# profile that stands for it (plan/speed/frameworks.py FRAMEWORKS: what each overlaps).
FRAMEWORK_BY_SOURCE = (
    ("Korthikanti", "megatron-2022"),  # Megatron-LM on Selene, 2022
    ("Narayanan", "megatron-2022"),  # Megatron-LM, 2021
    ("MT-NLG", "megatron-deepspeed"),  # Megatron-DeepSpeed: Megatron's kernels, DeepSpeed's pipeline and ZeRO-1
    ("bigscience", "megatron-deepspeed"),  # BLOOM: Megatron-DeepSpeed
    ("fms-fsdp", "fms-fsdp"),  # IBM: PyTorch FSDP, eager, gradients reduced in bf16
)


def framework_of(row: dict) -> str:
    for word, name in FRAMEWORK_BY_SOURCE:
        if word in row.get("source", ""):
            return name
    return "fivefold"


def published_with_profiles(path: Path, tool: Path = PUBLISHED_TOOL) -> int:
    """Run ../shared/tools/published_runs.py on `path` with each row's framework profile added to
    its extra_args (`--framework NAME`), and print its table."""
    import os
    import subprocess
    import tempfile

    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        fields, rows = reader.fieldnames, list(reader)
    for row in rows:
        name = framework_of(row)
        if name != "fivefold":
            row["extra_args"] = (row.get("extra_args", "") + f" --framework {name}").strip()
        print(f"  {row['name']}: {name} profile")
    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False, newline="") as out:
        writer = csv.DictWriter(out, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    fivefold = str(REPO / ".venv" / "bin" / "fivefold")
    try:
        return subprocess.run([sys.executable, str(tool), fivefold, out.name]).returncode
    finally:
        os.unlink(out.name)


# Narayanan et al. 2021 (arXiv 2104.04473) Table 1, weak scaling of GPT on Selene (A100 80 GB):
# (billions of parameters, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU). Sequence
# 2048, vocabulary 51,200, activation recomputation (the TFLOP/s count it: Megatron's formula with
# f = 4). Not stated per row, assumed: one sequence per micro-batch, 1F1B, GeLU MLP 4h written as
# the parameter-equal SwiGLU (ffn 8h/3), as in published_runs_dev.csv.
MEGATRON_TABLE1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def write_megatron_table1(path: Path) -> Path:
    """Table 1 as rows of the published-run tool's CSV format."""
    header = PUBLISHED_CSV.open().readline().strip().split(",") if PUBLISHED_CSV.is_file() else None
    fields = header or ["name", "group", "source", "gpu", "n_gpus", "dtype", "n_layers", "dim", "n_heads",
                        "n_kv_heads", "ffn_dim", "vocab", "tie_embeddings", "seq_len", "global_batch_seqs", "tp",
                        "pp", "dp", "cp", "ep", "zero", "sp", "mbs", "recompute", "pp_schedule", "pp_virtual",
                        "measure", "published_value", "extra_args", "headline"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        for size, heads, h, layers, tp, pp, gpus, batch, tflops in MEGATRON_TABLE1:
            writer.writerow(dict(
                name=f"megatron-table1-{size}b", group="megatron-t1", source="Narayanan et al. 2021 Table 1",
                gpu="a100", n_gpus=gpus, dtype="bf16", n_layers=layers, dim=h, n_heads=heads, n_kv_heads=heads,
                ffn_dim=round(8 * h / 3 / 64) * 64, vocab=51200, tie_embeddings="true", seq_len=2048,
                global_batch_seqs=batch, tp=tp, pp=pp, dp=gpus // (tp * pp), cp=1, ep=1, zero=0, sp="false",
                mbs=1, recompute="full", pp_schedule="1f1b", pp_virtual=1,
                measure="tflops_per_gpu_megatron_hfu", published_value=tflops, headline="yes"))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", action="append",
                    help="published runs (CSV; repeatable); default: both calibration files")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--worst", type=int, default=0, help="print the N worst tokens/s predictions")
    ap.add_argument("--published", nargs="?", const=str(PUBLISHED_CSV),
                    help="run ../shared/tools/published_runs.py on this CSV (default published_runs_dev.csv) "
                         "with each row's framework profile")
    ap.add_argument("--megatron-table1", action="store_true",
                    help="the same on Narayanan et al. 2021 Table 1 (10 runs, 32-3,072 A100s)")
    args = ap.parse_args(argv)
    if args.megatron_table1:
        import tempfile
        return published_with_profiles(write_megatron_table1(Path(tempfile.mkdtemp()) / "megatron_table1.csv"))
    if args.published:
        return published_with_profiles(Path(args.published))
    paths = [Path(p) for p in (args.csv or [DEFAULT_CSV, TORCHTITAN_CSV])]
    summaries = {}
    for path in paths:
        if not path.is_file():
            print(f"--csv {path} does not exist; point it at playbook_runs_dev.csv or "
                  "torchtitan_h100_2024.csv", file=sys.stderr)
            return 2
        with path.open() as f:
            rows = list(csv.DictReader(f))
        titan = "tps_per_gpu" in rows[0]
        summaries[path.name] = _print_titan(path, rows) if titan else _print_playbook(path, rows, args.worst)
        print()
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
