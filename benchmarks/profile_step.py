"""Where a single-process fivefold CPU step spends its time beyond the model's own math.

    OMP_NUM_THREADS=2 python benchmarks/profile_step.py [--steps 8] [--warmup 3] [--top 15] [--compile] [--dtype fp32|bf16]

Two views of the same run:
1. Phases: the trainer's step split into forward+backward, finishing gradients, gradient norm and
   clipping, optimizer update, and the rest (batch drawing, lr schedule, zero_grad, loss read,
   metrics), by timing the `Parallelized` methods the trainer calls (after warm-up; with one thread,
   the process's CPU time, as in vs_transformers.py; otherwise the wall clock).
2. Operators: torch.profiler over the steps after warm-up, top operators by self CPU time, so that
   anything that is not a matmul/attention/elementwise kernel of the model stands out.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vs_transformers  # noqa: E402
from vs_transformers import CPU_SHAPE, make_config  # noqa: E402

from fivefold.parallel.parallelized import Parallelized  # noqa: E402
from fivefold.train import trainer  # noqa: E402

PHASES = {"forward_backward": "forward+backward", "finish_grads": "finish grads",
          "clip_grad_norm": "grad norm + clip", "optimizer_step": "optimizer update"}


def timed_phases(times: dict[str, list[float]]):
    """Wrap the Parallelized methods the trainer calls so each call's wall time is recorded."""
    originals = {}
    for method in PHASES:
        original = getattr(Parallelized, method)
        originals[method] = original

        def wrapper(self, *args, _original=original, _name=method, **kwargs):
            start = vs_transformers.clock()
            out = _original(self, *args, **kwargs)
            times[_name].append(vs_transformers.clock() - start)
            return out

        setattr(Parallelized, method, wrapper)
    return originals


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--compile", action="store_true", help="train.compile (Inductor per block)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = p.parse_args(argv)
    cfg = make_config(CPU_SHAPE, args.seq_len, args.batch, args.steps, dtype=args.dtype, compile=args.compile)
    # One thread: time with the process's CPU time (a shared machine's wall clock is mostly waiting).
    clock_name = "cpu" if torch.get_num_threads() == 1 else "wall"
    vs_transformers.clock = vs_transformers.CLOCK[clock_name]
    print(f"clock {clock_name}, torch {torch.__version__}, threads {torch.get_num_threads()}, shape {CPU_SHAPE}, "
          f"seq {args.seq_len}, batch {args.batch}")

    # 1. phases
    times: dict[str, list[float]] = collections.defaultdict(list)
    originals = timed_phases(times)
    saved = trainer.time
    trainer.time = vs_transformers._Clock()  # the trainer's step_time_s on the same clock
    try:
        records = trainer.train(cfg).records
    finally:
        trainer.time = saved
        for name, fn in originals.items():
            setattr(Parallelized, name, fn)
    step = statistics.median(r["step_time_s"] for r in records[args.warmup:])
    print(f"\nmedian step {step * 1e3:.1f} ms (steps {args.warmup + 1}..{args.steps})")
    print("| phase | ms | share |\n|---|---:|---:|")
    accounted = 0.0
    for method, label in PHASES.items():
        ms = statistics.median(times[method][args.warmup:]) if times[method] else 0.0
        accounted += ms
        print(f"| {label} | {ms * 1e3:.1f} | {ms / step:.1%} |")
    print(f"| rest of the step (batch, lr, zero_grad, loss read, record) | {(step - accounted) * 1e3:.1f} "
          f"| {(step - accounted) / step:.1%} |")

    # 2. operators
    cfg = make_config(CPU_SHAPE, args.seq_len, args.batch, args.steps, dtype=args.dtype, compile=args.compile)
    seen = {"n": 0}
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    original_step = Parallelized.forward_backward

    def forward_backward(self, *a, **k):  # start profiling once the warm-up steps are over
        seen["n"] += 1
        if seen["n"] == args.warmup + 1:
            prof.start()
        return original_step(self, *a, **k)

    Parallelized.forward_backward = forward_backward
    try:
        trainer.train(cfg)
    finally:
        Parallelized.forward_backward = original_step
        prof.stop()
    print(f"\ntop {args.top} operators by self CPU time over {args.steps - args.warmup} steps:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=40))


if __name__ == "__main__":
    main()
