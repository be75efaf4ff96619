"""gloo's reduce-scatter against an all-to-all plus a local sum, the way tensor parallelism on CPU
reduce-scatters (parallel/tensor/layers.py), with all-gather and all-reduce of the same sizes beside.

    OMP_NUM_THREADS=1 python benchmarks/gloo_collectives.py [--nproc 2] [--mib 0.25,1,4] [--rounds 5] [--iters 20]

Each rank holds a chunk of `mib` MiB (fp32); the reduce-scatter input and the all-reduce tensor
are nproc chunks (what a sequence-parallel block reduces). Every collective moves, per rank, (N−1)
chunks out and in under the ring algorithms, except the all-reduce (2(N−1)). Rounds alternate the
four collectives; each cell is the median over rounds of the mean over `iters` calls, wall clock
(collectives wait by nature), measured on rank 0 after a barrier.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from spawn import run_on_ranks

# torch 2.13 renamed these (the old names warn); torch 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter_by_all_to_all(out: torch.Tensor, full: torch.Tensor, received: torch.Tensor) -> None:
    dist.all_to_all_single(received, full)
    torch.sum(received.view(dist.get_world_size(), -1), 0, out=out)


def collectives(chunk: torch.Tensor, full: torch.Tensor, received: torch.Tensor) -> dict:
    return {
        "all_gather": lambda: _all_gather(full, chunk),
        "reduce_scatter (gloo)": lambda: _reduce_scatter(chunk, full),
        "all_to_all + sum": lambda: reduce_scatter_by_all_to_all(chunk, full, received),
        "all_reduce": lambda: dist.all_reduce(full),
    }


def rank_main(args) -> dict:
    world = dist.get_world_size()
    table = {}
    for mib in args.mib:
        n = int(mib * 2**20 / 4)
        chunk, full, received = torch.randn(n), torch.randn(world * n), torch.empty(world * n)
        ops = collectives(chunk, full, received)
        samples = {name: [] for name in ops}
        for _ in range(args.rounds):
            for name, op in ops.items():
                op()  # warm-up call
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.iters):
                    op()
                samples[name].append((time.perf_counter() - start) / args.iters)
        table[mib] = {name: statistics.median(times) * 1e3 for name, times in samples.items()}
    return table


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--mib", default="0.25,1,4", help="MiB per rank's chunk, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    args.mib = [float(x) for x in args.mib.split(",")]
    table = run_on_ranks(args.nproc, rank_main, args, group_timeout_s=120)[0]  # rank 0's
    names = list(next(iter(table.values())))
    print(f"{args.nproc} gloo ranks, torch {torch.__version__}, ms per call (median of {args.rounds} rounds)\n")
    print("| MiB per rank | " + " | ".join(names) + " | reduce_scatter / all_to_all + sum |")
    print("|---:|" + "---:|" * (len(names) + 1))
    for mib, row in table.items():
        ratio = row["reduce_scatter (gloo)"] / row["all_to_all + sum"]
        print(f"| {mib:g} | " + " | ".join(f"{row[n]:.2f}" for n in names) + f" | {ratio:.2f} |")


if __name__ == "__main__":
    main()
