"""Where a tensor-parallel rank's step goes on CPU, against one process doing all the work.

    python benchmarks/profile_tp.py [--tp 2] [--steps 10] [--warmup 3] [--top 25]

The model and batch are benchmarks/scaling.py's. Two views:
1. Phases, per rank: CPU time and wall time of the trainer's calls (forward+backward, finishing
   gradients, norm + clip, optimizer update), median over the steps after the warm-up (the last
   step is left out: the communication ledger measures it). The same for 1 process.
2. Operators of rank 0 (torch.profiler over 3 steps after the warm-up), summed into groups: the
   matmuls, waiting in collectives, DTensor's machinery, copies; then the top operators.
One thread per rank; ranks are gloo processes on this machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scaling import MODEL, TRAIN  # noqa: E402
from spawn import run_on_ranks  # noqa: E402

PHASES = ("forward_backward", "finish_grads", "clip_grad_norm", "optimizer_step")
GROUPS = {  # operator-name fragments -> group (first match wins)
    "waiting in collectives": ("wait_tensor",),
    "matmuls": ("aten::mm", "aten::addmm", "aten::bmm"),
    "attention kernels": ("scaled_dot_product",),
    "DTensor (dispatch, wrapping, redistribute)": ("PythonSubclass", "ToTorchTensor", "FromTorchTensor",
                                                   "Redistribute", "_wrap_tensor_autograd"),
    "copies": ("aten::copy_", "aten::cat"),
}


def run(tp: int, steps: int, warmup: int, top: int) -> dict:
    from fivefold.configure import load_config
    from fivefold.parallel.parallelized import Parallelized
    from fivefold.train import trainer

    cfg = load_config(None, {"model": MODEL, "train": {**TRAIN, "steps": steps}, "parallel": {"tp": tp},
                             "log": {"progress": False, "comm_every": 10**6}})
    times: dict[str, list] = {name: [] for name in PHASES}
    originals = {name: getattr(Parallelized, name) for name in PHASES}
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    profiled = (warmup + 1, warmup + 4)  # forward_backward calls [start, stop)

    def timed(name):
        def call(self, *args, **kwargs):
            if name == "forward_backward":
                n = len(times[name]) + 1
                if n == profiled[0]:
                    prof.start()
                elif n == profiled[1]:
                    prof.stop()
            cpu, wall = time.process_time(), time.perf_counter()
            out = originals[name](self, *args, **kwargs)
            times[name].append((time.process_time() - cpu, time.perf_counter() - wall))
            return out
        return call

    for name in PHASES:
        setattr(Parallelized, name, timed(name))
    try:
        trainer.train(cfg)
    finally:
        for name, fn in originals.items():
            setattr(Parallelized, name, fn)
    kept = slice(warmup, steps - 1)
    phases = {name: (statistics.median(c for c, _ in v[kept]) * 1e3, statistics.median(w for _, w in v[kept]) * 1e3)
              for name, v in times.items()}
    events = prof.key_averages()
    n_steps = profiled[1] - profiled[0]
    grouped = {group: 0.0 for group in GROUPS}
    for event in events:
        for group, fragments in GROUPS.items():
            if any(f in event.key for f in fragments):
                grouped[group] += event.self_cpu_time_total / 1e3 / n_steps
                break
    total = sum(e.self_cpu_time_total for e in events) / 1e3 / n_steps
    table = events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=40)
    return {"phases": phases, "groups": grouped, "total": total, "table": table}


def show(label: str, out: dict) -> None:
    print(f"\n{label}: phases, ms per step (CPU time / wall)")
    for name, (cpu, wall) in out["phases"].items():
        print(f"  {name:18s} {cpu:7.1f} / {wall:7.1f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, model {MODEL}, train {TRAIN}, 1 thread per process")
    single = run(1, args.steps, args.warmup, args.top)
    show("1 process", single)
    ranks = dict(enumerate(run_on_ranks(args.tp, run, args.tp, args.steps, args.warmup, args.top,
                                        timeout_s=600, group_timeout_s=300)))
    for rank in sorted(ranks):
        show(f"tp={args.tp} rank {rank}", ranks[rank])
    print(f"\noperators, ms per step (profiler self time; 1 process | tp={args.tp} rank 0)")
    for group in GROUPS:
        print(f"  {group:44s} {single['groups'][group]:7.1f} | {ranks[0]['groups'][group]:7.1f}")
    print(f"  {'everything':44s} {single['total']:7.1f} | {ranks[0]['total']:7.1f}")
    print(f"\ntop operators of tp={args.tp} rank 0:\n{ranks[0]['table']}")


if __name__ == "__main__":
    main()
