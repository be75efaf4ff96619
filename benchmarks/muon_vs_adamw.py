"""Muon against AdamW: loss curves over the same tokens (an lr sweep each) and Muon's step-time cost per layout.

    OMP_NUM_THREADS=1 python benchmarks/muon_vs_adamw.py [--parts tiny,base,cost] [--jobs 2] \
        [--tiny-steps 300] [--base-steps 100] [--cost-models tiny] [--rounds 7] \
        [--plot benchmarks/muon_vs_adamw.png] [--json OUT]
    OMP_NUM_THREADS=1 python benchmarks/muon_vs_adamw.py --measure-base     # s/step of the base model, to size --base-steps
    python benchmarks/muon_vs_adamw.py --from-json OUT[,OUT2...]             # tables and plot again, without training

Curves (`tiny`, `base`): one process per run, `--jobs` runs at a time (one thread each), the
builtin corpus (the bytes of Python's standard library, as the shipped configs use), the same seed,
so every run of a model sees the same batches in the same order and starts from the same weights.
- `tiny`: the shipped tiny preset (0.8M parameters) with tiny.toml's training settings (seq 128,
  global batch 16, warmup 20, cosine to 0.1), `--tiny-steps` steps.
- `base`: a ~100M-parameter dense model of the same family: dim 768, 12 layers, 12 heads (no GQA),
  ffn 2560, byte vocabulary (tied), seq 128, global batch 8, `--base-steps` steps (warmup 10%).
Each model is swept over AdamW's lr and Muon's lr (`train.muon_adjust_lr = original`: Muon's own
lr scale, ~0.02; `train.lr` is then also the lr of the tensors AdamW keeps, the embedding and the
norms): tiny AdamW 1e-3, 3e-3, 6e-3, 1.2e-2 and Muon 0.01, 0.02, 0.04, 0.08, plus Muon with the
AdamW part held at AdamW's usual lr (`param_groups` lr_scale on `norm|bias|embedding`), Muon
`match_rms_adamw` (AdamW's lr for both parts) and `--extra-seeds` more seeds of the usual lrs;
base AdamW 1e-3, 3e-3 and Muon 0.01, 0.02. `sweep()` runs them in pairs, most informative first,
and --json is rewritten after every run, so a run stopped early keeps what it finished. The result of a run
is its held-out loss at the end (the trainer's eval: `eval_batches` batches of the validation
split) and the mean training loss of its last 10% of steps. The plot shows, per model, the best lr
of each optimizer by final held-out loss: training loss (moving average) and the held-out points.

Cost (`cost`): per layout (one process, dp2 zero1, dp2 zero3, tp2: layouts Muon runs on), one
spawn of its ranks, in which AdamW and Muon runs alternate `--rounds` times (A B, then B A, ...),
so the machine's load hits both alike. A round's time is rank 0's median step after `--warmup`
steps, on two clocks: the wall clock (ranks wait for each other; on a shared machine it also
waits for a core) and rank 0's process CPU time (every thread of the process: the work it did,
including gloo's, but not time spent descheduled). The ratio Muon / AdamW is taken within each round; its median and range over rounds are
reported. `--cost-models base` also times the ~100M model (minutes per layout).
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import multiprocessing
import os
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])  # benchmarks/: spawn

TINY = {"model": {"preset": "tiny"},
        "train": {"seq_len": 128, "global_batch": 16, "warmup": 20, "eval_batches": 8}}
BASE = {"model": {"preset": "tiny", "dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 12, "ffn_dim": 2560},
        "train": {"seq_len": 128, "global_batch": 8, "eval_batches": 4}}
MODELS = {"tiny": TINY, "base": BASE}
ADAMW_PART_AT_3E3 = "norm|bias|embedding: weight_decay=0, lr_scale={scale}"

# name -> train keys, in the order they run (`--jobs` at a time): an AdamW run beside a Muon run,
# the usual lr of each first, so that a run cut short by the machine still has the comparison.
def sweep(model: str) -> dict[str, dict]:
    adamw = lambda lr: {"optimizer": "adamw", "lr": lr}  # noqa: E731
    muon = lambda lr: {"optimizer": "muon", "lr": lr}  # noqa: E731
    if model == "tiny":
        return {"adamw lr=0.003": adamw(3e-3), "muon lr=0.02": muon(0.02),
                "adamw lr=0.001": adamw(1e-3), "muon lr=0.01": muon(0.01),
                "adamw lr=0.006": adamw(6e-3), "muon lr=0.04": muon(0.04),
                "muon match_rms_adamw lr=0.003": {"optimizer": "muon", "lr": 3e-3, "muon_adjust_lr": "match_rms_adamw"},
                "muon lr=0.02, adamw part 3e-3": {"optimizer": "muon", "lr": 0.02,
                                                  "param_groups": ADAMW_PART_AT_3E3.format(scale=3e-3 / 0.02)},
                "adamw lr=0.012": adamw(1.2e-2), "muon lr=0.08": muon(0.08)}
    return {"adamw lr=0.001": adamw(1e-3), "muon lr=0.02": muon(0.02),
            "adamw lr=0.003": adamw(3e-3), "muon lr=0.01": muon(0.01)}


def config(spec: dict, steps: int, keys: dict, seed: int = 0, eval_every: int | None = None, parallel=None):
    """spec: MODELS[name] (passed whole: spawned workers do not see a --base-shape the parent applied)."""
    from fivefold.configure import load_config

    train_keys = {**spec["train"], "steps": steps, "seed": seed, **keys}
    if "warmup" not in spec["train"]:
        train_keys.setdefault("warmup", max(1, steps // 10))
    if eval_every is not None:
        train_keys["eval_every"] = eval_every
    return load_config(None, {"model": dict(spec["model"]), "train": train_keys, "parallel": parallel or {},
                              "log": {"progress": False, "every": 0}})


def train_run(spec: dict, steps: int, keys: dict, seed: int) -> dict:
    """One training run in this (worker) process: its curve and its held-out losses."""
    import torch

    from fivefold.train.trainer import train

    torch.set_num_threads(1)
    start = time.time()
    result = train(config(spec, steps, keys, seed, eval_every=max(1, steps // 5)))
    losses = result.losses
    last = max(1, steps // 10)
    params = result.parallel.n_params
    return {"losses": losses, "val": [(r["step"], r["val_loss"]) for r in result.records if "val_loss" in r],
            "final_train": statistics.mean(losses[-last:]), "final_val": result.records[-1].get("val_loss"),
            "step_s": statistics.median(r["step_time_s"] for r in result.records[2:]), "params": params,
            "wall_s": time.time() - start, "keys": keys, "seed": seed}


def curves(model: str, steps: int, jobs: int, extra_seeds: int, done_cb=lambda partial: None) -> dict:
    runs = sweep(model)
    todo = [(name, 0) for name in runs]
    if extra_seeds and model == "tiny":  # the usual lr of each optimizer again, other seeds: the seed noise
        todo[6:6] = [(name, seed) for seed in range(1, extra_seeds + 1) for name in ("adamw lr=0.003", "muon lr=0.02")]
    out: dict[str, dict] = {}
    spec = MODELS[model]["train"]
    partial = {"steps": steps, "tokens_per_step": spec["seq_len"] * spec["global_batch"], "runs": out}
    ctx = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        pending = {pool.submit(train_run, MODELS[model], steps, runs[name], seed): (name, seed) for name, seed in todo}
        for done in futures.as_completed(pending):
            name, seed = pending[done]
            r = done.result()
            out[f"{name} seed={seed}" if seed else name] = r
            print(f"{model} {name} seed {seed}: final val {r['final_val']:.4f}, train {r['final_train']:.4f}, "
                  f"{r['step_s']:.2f} s/step, {r['wall_s']:.0f} s", flush=True)
            done_cb(partial)
    order = list(runs)
    partial["runs"] = {n: out[n] for n in sorted(out, key=lambda n: (order.index(n.split(" seed=")[0]), n))}
    return partial


# ---- cost per layout -------------------------------------------------------------------------------

LAYOUTS = {"1 process": {}, "dp2 zero1": {"dp": 2, "zero": 1}, "dp2 zero3": {"dp": 2, "zero": 3},
           "tp2": {"tp": 2}}
OPTIMIZERS = {"adamw": {"optimizer": "adamw", "lr": 3e-3}, "muon": {"optimizer": "muon", "lr": 0.02}}


class _TwoClocks:
    """Stands in for the trainer's `time` module: returns the wall clock and notes the CPU time
    beside it. The trainer reads time.perf_counter() three times a step (start, after backward,
    end), so calls 3k and 3k+2 bracket step k on both clocks."""

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def perf_counter(self) -> float:
        self.cpu.append(time.process_time())
        self.wall.append(time.perf_counter())
        return self.wall[-1]

    def steps(self, n: int) -> tuple[list[float], list[float]]:
        assert len(self.wall) == 3 * n, f"the trainer read the clock {len(self.wall)} times in {n} steps, not {3 * n}"
        return ([self.wall[3 * k + 2] - self.wall[3 * k] for k in range(n)],
                [self.cpu[3 * k + 2] - self.cpu[3 * k] for k in range(n)])


def _timed_round(spec: dict, layout: dict, keys: dict, steps: int, warmup: int) -> tuple[float, float]:
    import gc

    import fivefold.train.trainer as trainer_module

    clocks, saved = _TwoClocks(), trainer_module.time
    trainer_module.time = clocks
    try:
        trainer_module.train(config(spec, steps, {**keys, "warmup": 2, "schedule": "constant"}, parallel=layout))
    finally:
        trainer_module.time = saved
    wall, cpu = clocks.steps(steps)
    gc.collect()
    return statistics.median(wall[warmup:]), statistics.median(cpu[warmup:])


def cost_on_rank(spec: dict, layout: dict, rounds: int, steps: int, warmup: int) -> dict:
    import torch

    torch.set_num_threads(1)
    out = {name: {"wall": [], "cpu": []} for name in OPTIMIZERS}
    for r in range(rounds):
        order = list(OPTIMIZERS) if r % 2 == 0 else list(reversed(OPTIMIZERS))
        for name in order:
            wall, cpu = _timed_round(spec, layout, OPTIMIZERS[name], steps, warmup)
            out[name]["wall"].append(wall)
            out[name]["cpu"].append(cpu)
    return out


def cost(models: list[str], rounds: int, steps: int, warmup: int, layouts: list[str]) -> dict:
    from spawn import run_on_ranks

    report: dict[str, dict] = {}
    for model in models:
        n_steps, n_rounds = (steps, rounds) if model == "tiny" else (max(3, steps // 2), max(3, rounds // 2))
        n_warm = warmup if model == "tiny" else 1
        for name in layouts:
            layout = LAYOUTS[name]
            world = layout.get("dp", 1) * layout.get("tp", 1)
            rank0 = run_on_ranks(world, cost_on_rank, MODELS[model], layout, n_rounds, n_steps, n_warm, timeout_s=3600)[0]
            row = {"rounds": rank0}
            for clock in ("wall", "cpu"):
                ratios = [m / a for a, m in zip(rank0["adamw"][clock], rank0["muon"][clock])]
                row[clock] = {"adamw_s": statistics.median(rank0["adamw"][clock]),
                              "muon_s": statistics.median(rank0["muon"][clock]),
                              "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
            report[f"{model} {name}"] = row
            print(f"{model} {name}: " + "; ".join(
                f"{c} AdamW {1e3 * row[c]['adamw_s']:.0f} ms, Muon {1e3 * row[c]['muon_s']:.0f} ms, Muon/AdamW "
                f"{row[c]['ratio']:.3f} ({row[c]['ratio_min']:.3f}-{row[c]['ratio_max']:.3f})" for c in ("wall", "cpu")),
                flush=True)
    return report


# ---- report ----------------------------------------------------------------------------------------

def _optimizer_of(name: str) -> str:
    return "muon" if name.startswith("muon") else "adamw"


def best_runs(by_run: dict) -> dict[str, str]:
    """The run of each optimizer with the lowest final held-out loss (seed 0 runs)."""
    best: dict[str, str] = {}
    for name, r in by_run.items():
        if " seed=" in name:
            continue
        opt = _optimizer_of(name)
        if opt not in best or r["final_val"] < by_run[best[opt]]["final_val"]:
            best[opt] = name
    return best


def print_tables(results: dict) -> None:
    for model in ("tiny", "base"):
        if model not in results:
            continue
        res = results[model]
        params = next(iter(res["runs"].values()))["params"]
        print(f"\n{model}: {params / 1e6:.1f}M parameters, {res['steps']} steps x {res['tokens_per_step']} tokens "
              f"= {res['steps'] * res['tokens_per_step'] / 1e6:.2f}M tokens; final val = held-out loss at the end, "
              f"final train = mean of the last 10% of steps")
        print("| run | final val loss | final train loss | s/step (concurrent runs) |")
        print("|---|---:|---:|---:|")
        best = set(best_runs(res["runs"]).values())
        order = list(sweep(model))
        for name, r in sorted(res["runs"].items(), key=lambda kv: (order.index(kv[0].split(" seed=")[0]), kv[0])):
            mark = "**" if name in best else ""
            print(f"| {name} | {mark}{r['final_val']:.4f}{mark} | {r['final_train']:.4f} | {r['step_s']:.2f} |")
    if "cost" in results:
        print("\n| model, layout | AdamW ms/step | Muon ms/step | Muon/AdamW wall (min-max) | AdamW CPU ms | Muon CPU ms "
              "| Muon/AdamW CPU (min-max) | rounds |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, row in results["cost"].items():
            w, c = row["wall"], row["cpu"]
            print(f"| {name} | {1e3 * w['adamw_s']:.0f} | {1e3 * w['muon_s']:.0f} | {w['ratio']:.3f} "
                  f"({w['ratio_min']:.3f}-{w['ratio_max']:.3f}) | {1e3 * c['adamw_s']:.0f} | {1e3 * c['muon_s']:.0f} | "
                  f"{c['ratio']:.3f} ({c['ratio_min']:.3f}-{c['ratio_max']:.3f}) | {len(row['rounds']['adamw']['wall'])} |")


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    models = [m for m in ("tiny", "base") if m in results]
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        res = results[model]
        runs, tokens = res["runs"], res["tokens_per_step"]
        window = max(1, res["steps"] // 30)
        for opt, name in sorted(best_runs(runs).items()):
            r, color = runs[name], "C0" if opt == "adamw" else "C3"
            x = [(i + 1) * tokens / 1e6 for i in range(len(r["losses"]))]
            ax.plot(x, _smooth(r["losses"], window), color=color, linewidth=1.2, label=f"{name} (train, avg of {window})")
            ax.plot([s * tokens / 1e6 for s, _ in r["val"]], [v for _, v in r["val"]], "o--", color=color,
                    markersize=4, linewidth=0.8, label=f"{name} (held-out)")
            for other, o in runs.items():  # the same lr with another seed, if there is one: the seed noise
                if other.startswith(name + " seed="):
                    ax.plot(x[:len(o["losses"])], _smooth(o["losses"], window), color=color, linewidth=0.6, alpha=0.45,
                            label=f"{other} (train)")
        ax.set_xlabel("tokens (M)")
        ax.set_ylabel("loss (nats per byte)")
        params = next(iter(runs.values()))["params"]
        ax.set_title(f"{model}: {params / 1e6:.1f}M parameters, {res['steps']} steps")
        ax.legend(fontsize=7)
        low = min(min(v for _, v in r["val"]) for r in runs.values())
        ax.set_ylim(low - 0.1, min(max(r["losses"][0] for r in runs.values()), low + 2.5))
    fig.suptitle("fivefold: Muon vs AdamW, best lr of each, same batches")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def measure_base(steps: int = 4) -> None:
    for name, keys in OPTIMIZERS.items():
        r = train_run(BASE, steps, keys, 0)
        print(f"base {name}: {r['params'] / 1e6:.1f}M parameters, {r['step_s']:.2f} s/step (median of steps 3-{steps})",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="tiny,base,cost")
    parser.add_argument("--jobs", type=int, default=2, help="training runs at a time")
    parser.add_argument("--tiny-steps", type=int, default=300)
    parser.add_argument("--base-steps", type=int, default=100)
    parser.add_argument("--extra-seeds", type=int, default=1, help="more seeds of each optimizer's usual-lr run (tiny)")
    parser.add_argument("--base-shape", default="768,12,12,2560", help="base model: dim,layers,heads,ffn")
    parser.add_argument("--cost-models", default="tiny")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8, help="steps per timed run (tiny; base: half)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of a timed run's median (tiny)")
    parser.add_argument("--plot", default="benchmarks/muon_vs_adamw.png", help="PNG of the curves ('' = none)")
    parser.add_argument("--json", default="", help="write the numbers here (after each part)")
    parser.add_argument("--from-json", default="", help="read the numbers --json runs wrote (comma-separated) instead of running")
    parser.add_argument("--measure-base", action="store_true", help="only time a few steps of the base model")
    args = parser.parse_args()
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("note: run with OMP_NUM_THREADS=1 (each run and rank uses one thread)", file=sys.stderr)
    dim, layers, heads, ffn = (int(v) for v in args.base_shape.split(","))
    BASE["model"].update(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=heads, ffn_dim=ffn)
    if args.measure_base:
        measure_base()
        return
    if args.from_json:
        results = {}
        for path in args.from_json.split(","):  # parts run apart: later files add or replace parts
            with open(path) as f:
                results.update(json.load(f))
    else:
        results = {}

        def save(_=None):
            if args.json:
                with open(args.json, "w") as out:
                    json.dump(results, out)

        for part in args.parts.split(","):
            if part in ("tiny", "base"):
                steps = args.tiny_steps if part == "tiny" else args.base_steps
                results[part] = curves(part, steps, args.jobs, args.extra_seeds,
                                       lambda partial, part=part: (results.__setitem__(part, partial), save()))
            elif part == "cost":
                results["cost"] = cost(args.cost_models.split(","), args.rounds, args.steps, args.warmup,
                                       args.layouts.split(","))
            else:
                raise SystemExit(f"unknown part {part!r}")
            save()
    print_tables(results)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
