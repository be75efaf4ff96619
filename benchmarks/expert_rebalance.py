"""Hot-expert replicas (`parallel.ep_replicas`): per-ep-rank load before and after, and what they cost.

    python benchmarks/expert_rebalance.py      # a few minutes on 2 CPU cores (4 gloo ranks, fp32)

An MoE model (8 experts of width 128, top-2, dim 128, 2 MoE layers) with no load balancing
(`model.moe.balance = "none"`), so that the router drifts towards a few experts, trains STEPS steps
at dp4·ep4 (two experts per rank), re-planning every 2 steps, with 0, 1 and 2 replica slots per
rank and layer. The three runs route identically (replicas do not change the math), so they see
the same per-expert load and differ only in where the rows are computed.

Reported per MoE layer: `moe_layers[i].rank_imbalance` from the metrics (max/mean over the ep
ranks of the rows each computes, replicas counted where they run), averaged over the steps after
the first two plans (steps 5..STEPS). And the CPU time per step (time.process_time inside
forward/backward, gradient reduction and optimizer step, summed over the ranks, steps 3..STEPS)
as a ratio to the run without replicas: the price of the extra count exchange, row layout,
weight refresh and gradient fold. On a CPU the experts' matmuls are not where the ranks wait, so
this is the overhead side only; the gain shows where the busiest rank sets the step time (GPUs).
"""

from __future__ import annotations

import time

from fivefold.configure import load_config
from spawn import run_on_ranks

STEPS = 10
SETTINGS = {
    "model": {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 256,
              "moe": {"n_experts": 8, "top_k": 2, "expert_ffn_dim": 128, "balance": "none"}},
    "train": {"steps": STEPS, "seq_len": 64, "global_batch": 16, "lr": 3e-3, "warmup": 2, "seed": 11},
    "parallel": {"dp": 4, "ep": 4, "ep_rebalance_every": 2},
    "data": {"builtin_max_bytes": 300_000},
    "log": {"progress": False},
}


def _rank(replicas: int) -> dict:
    from fivefold.parallel.parallelized import Parallelized
    from fivefold.train.trainer import train

    cpu, step = [0.0], [0]

    def timed(method):
        def wrapper(self, *args, **kwargs):
            start = time.process_time()
            try:
                return method(self, *args, **kwargs)
            finally:
                if step[0] >= 2:  # after two warm-up steps
                    cpu[0] += time.process_time() - start
                if method.__name__ == "optimizer_step":
                    step[0] += 1
        return wrapper

    originals = {name: getattr(Parallelized, name) for name in ("forward_backward", "finish_grads", "optimizer_step")}
    for name, method in originals.items():
        setattr(Parallelized, name, timed(method))
    try:
        settings = {**SETTINGS, "parallel": {**SETTINGS["parallel"], "ep_replicas": replicas}}
        records = train(load_config(None, settings)).records
    finally:
        for name, method in originals.items():
            setattr(Parallelized, name, method)
    after = records[4:]
    layers = sorted(records[0]["moe_layers"], key=int)
    return {"imbalance": {i: sum(r["moe_layers"][i]["rank_imbalance"] for r in after) / len(after) for i in layers},
            "cpu_per_step": cpu[0] / (STEPS - 2)}


def main() -> None:
    runs = {}
    for replicas in (0, 1, 2):
        got = run_on_ranks(4, _rank, replicas, group_timeout_s=None)  # train() starts the group
        runs[replicas] = {"imbalance": got[0]["imbalance"], "cpu_per_step": sum(g["cpu_per_step"] for g in got)}
    base = runs[0]["cpu_per_step"]
    layers = list(runs[0]["imbalance"])
    print(f"dp4·ep4, 8 experts top-2, balance none, re-plan every 2 steps; steps 5..{STEPS}")
    print("| replica slots | " + " | ".join(f"layer {i} max/mean" for i in layers) + " | CPU s/step (4 ranks) | ratio |")
    print("|---|" + "---|" * len(layers) + "---|---|")
    for replicas, run in runs.items():
        cells = " | ".join(f"{run['imbalance'][i]:.3f}" for i in layers)
        print(f"| {replicas} | {cells} | {run['cpu_per_step']:.3f} | {run['cpu_per_step'] / base:.2f} |")


if __name__ == "__main__":
    main()
