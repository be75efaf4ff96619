"""Activation bytes per layer and token under tensor + sequence parallelism with selective
recomputation, measured, against the per-layer formula of Korthikanti et al. 2022
(arXiv 2205.05198: 34·s·b·h/t bytes per layer with TP + SP + selective recomputation, for 2-byte
activations; ../shared/data/README.md) and against fivefold's own earlier recipe (blocks
checkpointed whole), measured in the same run.

    OMP_NUM_THREADS=1 python benchmarks/activation_formula.py            # ~3 minutes on 2 CPU cores
    python benchmarks/activation_formula.py --tps 1,2,4 --dtype fp32 --shape 70b

Each tp degree runs in fresh local gloo processes. Per rank, train/activation_probe.py measures
what one micro-batch's forward keeps for backward (the planner's check: tests/test_plan_activations
.py) for the model with 2 and with 4 layers; the difference over 2 layers and the tokens is the bytes
per layer and token (embedding, output layer and logits cancel). Rank 0's numbers are shown (every
tp rank keeps the same). `whole` forces the earlier recipe (plan/memory/branch_split.py answering
"never apart"); rank 0's CPU time of a step (forward + backward, median of `--steps`; CPU time,
not wall time, so that other jobs on the machine's cores disturb it less) of both is shown as a
ratio: the new one recomputes nothing the old did not.

The shapes keep the proportions of Llama 3 (dim : q : kv : ffn) at dim 1024: `405b` (128 heads of
8, 8 kv heads: kv = dim/16, ffn = 3.25 dim) and `70b` (64 heads of 16, 8 kv heads: kv = dim/8,
ffn = 3.5 dim). The formula counts GeLU MLPs of 4h, dropout masks and 2-byte LayerNorm inputs; the
last column puts our parts beside its (at tp ≥ 4, where the branches are checkpointed apart).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch

from spawn import run_on_ranks

SHAPES = {
    "405b": {"dim": 1024, "n_heads": 128, "n_kv_heads": 8, "ffn_dim": 3328},
    "70b": {"dim": 1024, "n_heads": 64, "n_kv_heads": 8, "ffn_dim": 3584},
}
SEQ = 512


def _config(shape: str, tp: int, layers: int, dtype: str):
    from fivefold.configure import load_config

    return load_config(None, {
        "model": {**SHAPES[shape], "n_layers": layers, "vocab_size": 512},
        "parallel": {"tp": tp},
        "train": {"seq_len": SEQ, "micro_batch": 1, "global_batch": 1, "recompute": "selective", "dtype": dtype},
        "log": {"progress": False}})


def _measure(shape: str, tp: int, dtype: str, whole: bool, steps: int) -> dict:
    import fivefold.parallel.recompute as recompute
    from fivefold.train.activation_probe import forward_kept_bytes
    from fivefold.train.trainer import autocast, setup

    if whole:
        recompute.split_branches = lambda *args: False
    out = {}
    for layers in (2, 4):
        cfg = _config(shape, tp, layers, dtype)
        rt, par = setup(cfg)
        batch = torch.randint(0, 512, (1, SEQ + 1), generator=torch.Generator().manual_seed(0))
        out[layers] = forward_kept_bytes(par, batch, lambda: autocast(cfg, rt.device))
    times = []
    for _ in range(steps + 1):  # the first is a warm-up
        start = time.process_time()
        inputs, labels, positions = par.split_sequence(batch)
        with autocast(cfg, rt.device):
            loss = par.forward_loss(inputs, labels, positions)
        par.backward(loss)
        times.append(time.process_time() - start)
    return {"per_layer_token": (out[4] - out[2]) / 2 / SEQ, "step_s": statistics.median(times[1:])}


def run(shape: str, tp: int, dtype: str, whole: bool, steps: int) -> dict:
    if tp == 1:
        return _measure(shape, tp, dtype, whole, steps)
    return run_on_ranks(tp, _measure, shape, tp, dtype, whole, steps, timeout_s=1200, group_timeout_s=600)[0]


def explain(shape: str, tp: int, dtype: str) -> str:
    """Our bytes per token and layer against the formula's, part by part (the split tp ≥ 4 makes:
    benchmarks/RESULTS.md explains each)."""
    m = SHAPES[shape]
    h, f, A, t = m["dim"], m["ffn_dim"], 2 if dtype == "bf16" else 4, tp
    head = h // m["n_heads"]
    q, kv = h / t, m["n_kv_heads"] * head / t
    unit = h / t * A / 2  # the formula's s·b·h/t, in bytes per token
    stream = 2 * h / t * 4
    attention = (q + 2 * kv + q) * A + 4 * m["n_heads"] / t
    return (f"stream {stream:,.0f} vs norm and matmul inputs {8 * unit:,.0f}; attention {attention:,.0f} vs "
            f"{9 * unit:,.0f}; SwiGLU {3 * f / t * A:,.0f} vs GeLU MLP {17 * unit:,.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tps", default="1,2,4,8")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--shape", default="405b", choices=tuple(SHAPES))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    h = SHAPES[args.shape]["dim"]
    A = 2 if args.dtype == "bf16" else 4
    print(f"shape {args.shape} {SHAPES[args.shape]}, seq {SEQ}, {args.dtype}, selective recomputation, sp on; "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, {datetime.date.today()}")
    print("| tp | measured B/layer/token | formula 34·h/t·A/2 | ratio | whole blocks (before) | "
          "before / now | CPU time per step, now / before | the difference, explained |")
    print("|---|---|---|---|---|---|---|---|")
    for tp in (int(t) for t in args.tps.split(",")):
        now = run(args.shape, tp, args.dtype, False, args.steps)
        before = run(args.shape, tp, args.dtype, True, args.steps)
        formula = 34 * h / tp * A / 2
        print(f"| {tp} | {now['per_layer_token']:,.0f} | {formula:,.0f} | {now['per_layer_token'] / formula:.2f} | "
              f"{before['per_layer_token']:,.0f} | {before['per_layer_token'] / now['per_layer_token']:.2f} | "
              f"{now['step_s'] / before['step_s']:.2f} | {explain(args.shape, tp, args.dtype)} |", flush=True)


if __name__ == "__main__":
    main()
