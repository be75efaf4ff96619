"""CPU time of ring attention with a sliding window against full causal ring attention.

    OMP_NUM_THREADS=1 python benchmarks/ring_window.py                 # cp 2, 8 windows, ~1 minute
    python benchmarks/ring_window.py --cp 4 --window 256 --windows 8 --rounds 5

Each rank (local gloo processes, one thread each) holds its load-balanced share of one sequence of
`--windows` windows and times forward + backward of the ring (parallel/context/ring.py) with the
window and without it, alternating the two in every round so that drift on a shared machine hits
both alike. It reports the median CPU time per rank and call, the ratio (full / windowed), the
blocks each computed and skipped, and — the bound a window allows — the fraction of the causal
score matrix's pairs the window keeps. Sinks are on in both (gpt-oss), as is one query group per kv
head (GQA 4:1).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from spawn import run_on_ranks


def _time_rank(args) -> dict:
    import torch.distributed as dist

    from fivefold.parallel.context.apply import ContextParallelAttention, local_positions

    rank, cp = dist.get_rank(), dist.get_world_size()
    seq = args.window * args.windows
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, args.heads, seq, args.head_dim, generator=g)
    k, v = (torch.randn(1, args.heads // 4, seq, args.head_dim, generator=g) for _ in range(2))
    dout = torch.randn(q.shape, generator=g)
    sinks = torch.randn(args.heads, generator=g).requires_grad_()
    mine = local_positions(rank, cp, seq // cp)
    local = [t[:, :, mine].contiguous() for t in (q, k, v)]
    cores = {"windowed": ContextParallelAttention(dist.group.WORLD, "ring", args.window),
             "full": ContextParallelAttention(dist.group.WORLD, "ring", 0)}
    times = {name: [] for name in cores}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, core in (cores.items() if round_ % 2 == 0 else reversed(cores.items())):
            leaves = [t.clone().requires_grad_() for t in local]
            dist.barrier()
            start = time.process_time()
            core(*leaves, None, sinks).backward(dout[:, :, mine])
            if round_:
                times[name].append(time.process_time() - start)
    calls = args.rounds + 1
    return {name: statistics.median(t) for name, t in times.items()} | {
        f"{name} blocks": {what: n // calls for what, n in core.blocks.items()} for name, core in cores.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--windows", type=int, default=8, help="the sequence, in windows")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    seq = args.window * args.windows
    kept = sum(min(i + 1, args.window) for i in range(seq)) / (seq * (seq + 1) / 2)
    print(f"ring attention, cp {args.cp}, sequence {seq} = {args.windows} windows of {args.window}, "
          f"{args.heads} heads ({args.heads // 4} kv), head dim {args.head_dim}, sinks; forward + backward, "
          f"median of {args.rounds} alternating rounds, CPU time per rank (one thread)")
    print(f"the window keeps {kept:.1%} of the causal pairs (the most it can save: {1 / kept:.2f}x)")
    for rank, r in enumerate(run_on_ranks(args.cp, _time_rank, args)):
        print(f"rank {rank}: full {r['full'] * 1e3:8.1f} ms  windowed {r['windowed'] * 1e3:8.1f} ms  "
              f"ratio {r['full'] / r['windowed']:.2f}x  blocks full {r['full blocks']}  windowed {r['windowed blocks']}")


if __name__ == "__main__":
    main()
