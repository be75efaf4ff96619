"""What this CPU core can do at the model's own matmuls: the "CPU MFU" ceiling of the CPU benchmarks.

    OMP_NUM_THREADS=1 python benchmarks/cpu_roofline.py [--dim 256 --n-layers 4 ...] [--preset P]
        [--seq-len 128 --batch 8] [--dtype fp32|bf16] [--repeats 20] [--json]

A GPU's MFU is measured against its datasheet peak. A CPU has no such number a benchmark can
trust (turbo, AVX-512 frequency licences, a shared VM), so this measures one. It times, with one
thread, every matmul a training step of the model runs: for each projection (q, k, v, o, w1, w2, w3
per layer, the output layer) on batch·seq tokens, the forward x·Wᵀ and the two backward products
(the input gradient g·W and the weight gradient gᵀ·x). The rate of the whole set, FLOPs over time,
is the roofline: what a step would reach if it did nothing but these matmuls, back to back, with
warm caches. A benchmark's "CPU MFU" is its model FLOP/s (the planner's formula, as the trainer's
MFU) over this rate; `cpu_mfu(cfg, step_s)` computes it, and vs_transformers.py prints it.

Attention's score and value products are not in the set: with seq 128 and head_dim 32 they are
small, memory-bound matmuls, which would lower the roofline and flatter the MFU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def projection_shapes(model_cfg, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, tokens, in_features, out_features) of every dense matmul of one forward."""
    m = model_cfg
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    layer = [("q", m.dim, q), ("k", m.dim, kv), ("v", m.dim, kv), ("o", q, m.dim),
             ("w1", m.dim, m.ffn_dim), ("w3", m.dim, m.ffn_dim), ("w2", m.ffn_dim, m.dim)]
    shapes = [(name, tokens, i, o) for name, i, o in layer] * m.n_layers
    return shapes + [("output", tokens, m.dim, m.vocab_size)]


def _timed(fn, repeats: int) -> float:
    """The fastest of `repeats` runs, in process CPU time: with one thread that is the work done,
    whatever else shares the core (the clock vs_transformers.py times steps with), and the fastest
    run is what the core can do."""
    fn()  # warm caches and the allocator
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def gemm_rates(shapes, dtype: torch.dtype = torch.float32, repeats: int = 20) -> list[dict]:
    """Per distinct shape: the seconds of its forward and two backward matmuls, and their FLOP/s."""
    out = []
    for name, t, i, o in dict.fromkeys(shapes):  # each distinct shape once
        x, w, g = torch.randn(t, i, dtype=dtype), torch.randn(o, i, dtype=dtype), torch.randn(t, o, dtype=dtype)
        seconds = (_timed(lambda: x @ w.t(), repeats) + _timed(lambda: g @ w, repeats)
                   + _timed(lambda: g.t() @ x, repeats))
        flops = 3 * 2 * t * i * o
        out.append({"name": name, "tokens": t, "in": i, "out": o, "seconds": seconds, "flops": flops,
                    "flops_per_s": flops / seconds})
    return out


def roofline(model_cfg, tokens: int, dtype: torch.dtype = torch.float32, repeats: int = 20) -> tuple[float, list[dict]]:
    """FLOP/s of one step's dense matmuls run back to back (each shape weighted by its count)."""
    shapes = projection_shapes(model_cfg, tokens)
    rates = {(r["name"], r["tokens"], r["in"], r["out"]): r for r in gemm_rates(shapes, dtype, repeats)}
    total_flops = sum(rates[s]["flops"] for s in shapes)
    total_s = sum(rates[s]["seconds"] for s in shapes)
    return total_flops / total_s, list(rates.values())


def cpu_mfu(cfg, step_s: float, peak_flops_per_s: float) -> float:
    """A step's model FLOP/s (the planner's and the trainer's formula) over the measured roofline."""
    from fivefold.plan.model_stats import model_stats

    tokens = cfg.train.global_batch * cfg.train.seq_len
    return model_stats(cfg.model).mfu(cfg.train.seq_len, tokens / step_s, peak_flops_per_s)


def main(argv=None) -> int:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from vs_transformers import CPU_SHAPE, make_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--preset", default=None)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", action="store_true")
    for key, value in CPU_SHAPE.items():
        if isinstance(value, int) and not isinstance(value, bool):
            p.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    args = p.parse_args(argv)
    model = {} if args.preset else {k: getattr(args, k, v) for k, v in CPU_SHAPE.items()}
    cfg = make_config(model, args.seq_len, args.batch, 1, args.dtype, preset=args.preset)
    peak, rates = roofline(cfg.model, args.batch * args.seq_len, DTYPES[args.dtype], args.repeats)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.dtype}, tokens "
          f"{args.batch * args.seq_len}, model {json.dumps(model or args.preset)}")
    for r in rates:
        print(f"  {r['name']:>6} {r['tokens']}x{r['in']}x{r['out']}: {r['flops_per_s'] / 1e9:6.1f} GFLOP/s "
              "(forward + both backward products)")
    print(f"roofline {peak / 1e9:.1f} GFLOP/s: one step's dense matmuls back to back")
    if args.json:
        print(json.dumps({"roofline_flops_per_s": peak, "shapes": rates}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
