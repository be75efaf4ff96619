"""One GPU: MFU and tokens/s of a ~1B Llama at sequence 4096, eager/compiled x no/full recomputation
(bf16), FP8 dense projections (torchao tensorwise) compiled and eager, compile seconds, the
transformers comparison, and the planner's activation bytes against what the forward
really keeps on the device; writes a Markdown table and a JSON file.

    bash benchmarks/gpu.sh                  # the real thing on one CUDA device (< 9 minutes)
    bash benchmarks/gpu.sh --dry-run        # the same code path, a tiny shape on CPU, seconds

Each variant runs in its own subprocess (a failure or an out-of-memory in one does not stop the
others; compile caches and allocator state do not leak between them) with its own time limit.
The table says, per variant: tokens/s, MFU (fivefold's own metric: 6N + 12·L·d·s FLOPs per token
over the device's dense bf16 peak), step time, peak memory; then the transformers loop on the same
shape and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from vs_transformers import make_config, transformers_round  # noqa: E402

# Variant name -> (compile, recompute, train.fp8). "transformers" is the HF loop (eager, no
# recomputation). In the order they run: if the time budget runs out, the last ones are skipped.
VARIANTS = {
    "eager": (False, "none", ""),
    # Not a speed run: bytes one batch's forward keeps for backward (train/activation_probe.py)
    # under each recomputation mode, beside plan/memory/activations.py's prediction for the same layout.
    "activations": (False, "none", ""),
    "transformers": (False, "none", ""),
    "compile": (True, "none", ""),
    # FP8 dense projections (torchao, tensorwise) against the bf16 rows above: compiled, as torchao's
    # float8 recipes are meant to run (its casts fuse), and eager.
    "compile+fp8": (True, "none", "tensorwise"),
    "fp8": (False, "none", "tensorwise"),
    "eager+recompute": (False, "full", ""),
    "compile+recompute": (True, "full", ""),
}
REAL = dict(preset="llama3-1b", model={}, seq_len=4096, batch=4, steps=12, warmup=4, dtype="bf16",
            timeout_s=150, budget_s=540)
DRY = dict(preset=None, model=dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                                   vocab_size=256, tie_embeddings=True, rope_theta=10000.0,
                                   rope_scaling=0.0, max_seq_len=256),
           seq_len=32, batch=2, steps=3, warmup=1, dtype="bf16", timeout_s=300, budget_s=0)


def measure_activations(shape: dict) -> list[dict]:
    from fivefold.plan import plan_layout
    from fivefold.plan.layout import layout_from_config
    from fivefold.train.activation_probe import forward_kept_bytes
    from fivefold.train.trainer import autocast, setup

    rows = []
    for mode in ("none", "selective", "full"):
        cfg = make_config(shape["model"], shape["seq_len"], shape["batch"], shape["steps"], shape["dtype"],
                          recompute=mode, preset=shape["preset"])
        rt, par = setup(cfg)
        batch = torch.randint(0, cfg.model.vocab_size, (shape["batch"], shape["seq_len"] + 1), device=rt.device)
        kept = forward_kept_bytes(par, batch, lambda: autocast(cfg, rt.device))
        gpu = "h100" if rt.device.type == "cuda" else "cpu"
        predicted = plan_layout(cfg, layout_from_config(cfg), gpu=gpu).memory.activations
        rows.append({"recompute": mode, "measured_bytes": kept, "predicted_bytes": predicted})
        del par, batch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def run_variant(name: str, shape: dict) -> dict:
    """Runs in the child process: one variant, returns its measurements."""
    if name == "activations":
        start = time.perf_counter()
        return {"variant": name, "activations": measure_activations(shape),
                "wall_s": time.perf_counter() - start}
    from fivefold.plan.model_stats import model_stats
    from fivefold.train.metrics import peak_flops
    from fivefold.train.trainer import train

    compile_, recompute, fp8 = VARIANTS[name]
    cfg = make_config(shape["model"], shape["seq_len"], shape["batch"], shape["steps"], shape["dtype"],
                      compile="true" if compile_ else "false", recompute=recompute, preset=shape["preset"],
                      fp8=fp8)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens = shape["batch"] * shape["seq_len"]
    start = time.perf_counter()
    if name == "transformers":
        step_s, compile_s = transformers_round(cfg, shape["warmup"], device)
        n_params = None
    else:
        result = train(cfg)
        step_s = statistics.median(r["step_time_s"] for r in result.records[shape["warmup"]:])
        compile_s = sum(r.get("compile_s", 0.0) for r in result.records)
        n_params = result.parallel.n_params
    if n_params is None:  # the same model; count it the way fivefold does (on meta: no memory, no init)
        from fivefold.models import build_meta_model

        n_params = sum(p.numel() for p in build_meta_model(cfg.model).parameters())
    peak = peak_flops(device, shape["dtype"])
    # The trainer's and the planner's MFU formula (active parameters): one device, so tokens/s per device.
    mfu = model_stats(cfg.model).mfu(shape["seq_len"], tokens / step_s, peak) if peak else None
    mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"variant": name, "tokens_per_sec": tokens / step_s, "step_time_s": step_s, "mfu": mfu,
            "peak_mem_bytes": mem, "n_params": n_params, "compile_s": compile_s,
            "wall_s": time.perf_counter() - start}


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads), torch {torch.__version__}"


def table(rows: list[dict], shape: dict, dry: bool) -> str:
    what = "dry run (tiny shape, CPU)" if dry else f"{shape['preset']}"
    out = [f"## GPU benchmark — {what}", "",
           f"{machine()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; seq {shape['seq_len']}, "
           f"batch {shape['batch']}, {shape['dtype']}, median of steps {shape['warmup'] + 1}..{shape['steps']}", "",
           "| variant | tokens/s | MFU | step (s) | peak mem (GiB) | compile (s) | status |",
           "|---|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        if "error" in row:
            out.append(f"| {row['variant']} | | | | | | {row['error']} |")
            continue
        if "activations" in row:
            continue  # its own table below
        mfu = f"{row['mfu'] * 100:.1f}%" if row["mfu"] is not None else "n/a"
        mem = f"{row['peak_mem_bytes'] / 2**30:.1f}" if row["peak_mem_bytes"] else "n/a"
        out.append(f"| {row['variant']} | {row['tokens_per_sec']:.0f} | {mfu} | {row['step_time_s']:.3f} "
                   f"| {mem} | {row['compile_s']:.1f} | ok ({row['wall_s']:.0f} s) |")
    for row in rows:
        if "activations" in row:
            out += ["", "Activation bytes one batch's forward keeps (measured) vs the planner:", "",
                    "| recompute | measured (GiB) | predicted (GiB) | predicted / measured |",
                    "|---|---:|---:|---:|"]
            out += [f"| {a['recompute']} | {a['measured_bytes'] / 2**30:.3f} | {a['predicted_bytes'] / 2**30:.3f} "
                    f"| {a['predicted_bytes'] / a['measured_bytes']:.3f} |" for a in row["activations"]]
    by = {r["variant"]: r for r in rows if "error" not in r and "activations" not in r}
    if "transformers" in by:
        best = max((r for n, r in by.items() if n != "transformers"), key=lambda r: r["tokens_per_sec"],
                   default=None)
        if best is not None:
            out += ["", f"fivefold best ({best['variant']}) / transformers tokens/s: "
                        f"{best['tokens_per_sec'] / by['transformers']['tokens_per_sec']:.2f}x"
                        + (f"; eager / transformers: {by['eager']['tokens_per_sec'] / by['transformers']['tokens_per_sec']:.2f}x"
                           if "eager" in by else "")]
    for fp8, bf16 in (("compile+fp8", "compile"), ("fp8", "eager")):
        if fp8 in by and bf16 in by:
            out.append(f"{fp8} / {bf16} tokens/s: {by[fp8]['tokens_per_sec'] / by[bf16]['tokens_per_sec']:.2f}x")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shape on CPU (forced even with a GPU)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of "
                   + ", ".join(VARIANTS))
    p.add_argument("--out", default=None, help="Markdown table file (default: benchmarks/gpu_results.md, "
                   "or gpu_dry_run.md with --dry-run); JSON beside it")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--timeout", type=int, default=None, help="seconds per variant")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: run one variant, print JSON
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.one:
        print("RESULT " + json.dumps(run_variant(args.one, json.loads(args.shape))), flush=True)
        return 0

    dry = args.dry_run or not torch.cuda.is_available()
    if dry and not args.dry_run:
        print("no CUDA device: running the CPU dry run (tiny shape)", flush=True)
    shape = dict(DRY if dry else REAL)
    for key in ("steps", "batch", "seq_len"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    shape["warmup"] = min(shape["warmup"], shape["steps"] - 1)
    timeout = args.timeout or shape["timeout_s"]
    env = dict(os.environ)
    if dry:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is CPU even on a GPU machine
    rows = []
    deadline = time.perf_counter() + shape["budget_s"] if shape["budget_s"] else None  # the whole run
    for name in args.variants.split(","):
        if name not in VARIANTS:
            p.error(f"--variants: unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        start = time.perf_counter()
        limit = timeout if deadline is None else min(timeout, deadline - start)
        if limit < 20:
            rows.append({"variant": name, "error": "skipped: the run's time budget is spent"})
            print(f"{name}: skipped", flush=True)
            continue
        try:
            proc = subprocess.run([sys.executable, __file__, "--one", name, "--shape", json.dumps(shape)],
                                  env=env, capture_output=True, text=True, timeout=limit)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode == 0 and lines:
                rows.append(json.loads(lines[-1][len("RESULT "):]))
            else:
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]
                rows.append({"variant": name, "error": f"failed (rc {proc.returncode}): {last}"})
        except subprocess.TimeoutExpired:
            rows.append({"variant": name, "error": f"timed out after {limit:.0f} s"})
        print(f"{name}: {json.dumps(rows[-1])} [{time.perf_counter() - start:.0f} s]", flush=True)
    text = table(rows, shape, dry)
    out = Path(args.out) if args.out else HERE / ("gpu_dry_run.md" if dry else "gpu_results.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"machine": machine(), "shape": shape, "rows": rows},
                                                   indent=1))
    print(text)
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
