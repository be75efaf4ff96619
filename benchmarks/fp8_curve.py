"""Loss curves of bf16 against FP8 (train.fp8 tensorwise and rowwise) on one process.

    python benchmarks/fp8_curve.py [--steps 300] [--seeds 0] [--plot benchmarks/fp8_curve.png] [--json OUT]
    python benchmarks/fp8_curve.py --from-json OUT    # the table and plot again, without training

The same small Llama (dim 128, 4 layers, seq 128, global batch 16, the builtin corpus), the same
seed and batches, trained three times: bf16 compute over fp32 master weights, then with the dense
projections' matmuls in FP8 through torchao (docs/precision.md). It prints, for each FP8 recipe,
the final loss (mean of the last 20 steps' training losses, and the held-out loss at the end)
divided by bf16's, and the median step time divided by bf16's. With several --seeds it also prints
how far bf16's own final loss moves from seed to seed, the scale an FP8 gap is read against. On a
CPU, FP8's matmuls run through `torch._scaled_mm`'s CPU kernel: the step-time ratio says what FP8
costs here, not what it gains on an FP8 GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics

from fivefold.configure import load_config
from fivefold.train.trainer import train

SHAPE = {"model": {"dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 384},
         "train": {"seq_len": 128, "global_batch": 16, "lr": 3e-3, "warmup": 20, "dtype": "bf16"},
         "data": {"builtin_max_bytes": 2_000_000}, "log": {"progress": False}}
RUNS = {"bf16": "", "fp8 tensorwise": "tensorwise", "fp8 rowwise": "rowwise"}
LAST = 20  # steps averaged into the final training loss
WARMUP = 5  # steps left out of the median step time


def run(fp8: str, steps: int, seed: int) -> dict:
    train_keys = {**SHAPE["train"], "steps": steps, "seed": seed, "fp8": fp8, "eval_every": steps, "eval_batches": 8}
    result = train(load_config(None, {**SHAPE, "train": train_keys}))
    losses = result.losses
    return {"losses": losses, "final": statistics.mean(losses[-LAST:]),
            "val": [r["val_loss"] for r in result.records if "val_loss" in r][-1],
            "step_s": statistics.median(r["step_time_s"] for r in result.records[WARMUP:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--plot", default="benchmarks/fp8_curve.png", help="PNG of the curves ('' = none)")
    parser.add_argument("--json", default="", help="write the numbers here")
    parser.add_argument("--from-json", default="", help="read the numbers a --json run wrote instead of training")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            results = {int(seed): by_run for seed, by_run in json.load(f).items()}
        seeds = list(results)
        args.steps = len(results[seeds[0]]["bf16"]["losses"])
    else:
        seeds = [int(s) for s in args.seeds.split(",")]
        results = {seed: {name: run(fp8, args.steps, seed) for name, fp8 in RUNS.items()} for seed in seeds}
    print(f"{args.steps} steps, seeds {seeds}: final loss = mean of the last {LAST} steps; val = held-out loss at the end")
    print("| seed | run | final loss | / bf16 | val loss | / bf16 | step ms | / bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    for seed, by_run in results.items():
        base = by_run["bf16"]
        for name, r in by_run.items():
            print(f"| {seed} | {name} | {r['final']:.4f} | {r['final'] / base['final']:.4f} | {r['val']:.4f} | "
                  f"{r['val'] / base['val']:.4f} | {1000 * r['step_s']:.1f} | {r['step_s'] / base['step_s']:.2f} |")
    if len(seeds) > 1:
        finals = [by_run["bf16"]["final"] for by_run in results.values()]
        print(f"bf16's final loss over the seeds: {min(finals):.4f} to {max(finals):.4f} "
              f"({(max(finals) - min(finals)) / statistics.mean(finals):.2%} of their mean)")
    if args.json and not args.from_json:
        with open(args.json, "w") as out:
            json.dump({str(s): v for s, v in results.items()}, out)
    if args.plot:
        _plot(results[seeds[0]], args.plot, args.steps)


def _plot(by_run: dict, path: str, steps: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, (whole, ratio) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    base = by_run["bf16"]["losses"]
    for i, (name, r) in enumerate(by_run.items()):
        whole.plot(range(1, steps + 1), r["losses"], label=name, linewidth=1, color=f"C{i}")
        if name != "bf16":
            ratio.plot(range(1, steps + 1), [a / b for a, b in zip(r["losses"], base)], label=f"{name} / bf16",
                       linewidth=1, color=f"C{i}")
    whole.set_ylabel("training loss")
    whole.legend()
    ratio.axhline(1.0, color="grey", linewidth=0.5)
    ratio.set_ylabel("loss / bf16")
    ratio.set_xlabel("step")
    ratio.legend()
    fig.suptitle("fivefold: bf16 vs FP8 (torchao), one CPU process")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
