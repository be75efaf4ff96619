"""Activation memory per rank and step time against sequence length, for cp = 1, 2, 4.

    OMP_NUM_THREADS=1 python benchmarks/context_memory.py              # ~9 minutes on 2 CPU cores
    python benchmarks/context_memory.py --seqs 1024,4096 --cps 1,2 --method allgather

Each (cp, sequence length) runs in fresh local gloo processes, one per cp rank: one sequence
through a small attention-heavy Llama (forward + backward; no optimizer, no gradient reduction),
one warm-up step, then the median of `--steps` timed ones. Per rank it reports:
- activations: bytes saved for backward, measured with `torch.autograd.graph.saved_tensors_hooks`
  (each storage counted once; parameters excluded). This is what context parallelism divides.
- peak RSS growth: the process's resident-set high-water mark during the steps, over its value
  before them; it adds the transient buffers (attention score tiles, messages) to the above.
`--cap-mib` is an activation budget per rank, enforced by the same hook: a run that would save
more stops in its forward pass and is reported as over the cap.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch

from spawn import run_on_ranks

MODEL = {"dim": 128, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2, "ffn_dim": 256, "vocab_size": 256,
         "max_seq_len": 1 << 16}


class OverCap(Exception):
    pass


class SavedBytes:
    """Pack hook that adds up the storages autograd keeps for backward, refusing past a cap."""

    def __init__(self, params, cap_bytes: int):
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.cap_bytes, self.seen, self.total = cap_bytes, set(), 0

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.seen and key not in self.param_storages:
            self.seen.add(key)
            self.total += storage.nbytes()
            if self.cap_bytes and self.total > self.cap_bytes:
                raise OverCap(self.total)
        return tensor

    @staticmethod
    def unpack(tensor):
        return tensor


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def rank_main(cp, seq, method, cap_bytes, steps) -> dict:
    import torch.distributed as dist

    from fivefold.configure import load_config
    from fivefold.models import build_model
    from fivefold.parallel.context.apply import ContextParallelAttention, SequenceSplit
    from fivefold.parallel.loss import lm_loss

    rank = int(os.environ["RANK"])  # set by spawn.py
    try:
        model = build_model(load_config(None, {"model": MODEL, "train": {"seq_len": seq}}).model, seed=0)
        if cp > 1:
            for block in model.layers.values():
                block.attention.core = ContextParallelAttention(dist.group.WORLD, method)
        windows = torch.randint(0, MODEL["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(0))
        inputs, labels, positions = SequenceSplit(rank, cp)(windows)
        rss_before, times, saved = max_rss_bytes(), [], 0
        for _ in range(steps + 1):
            meter = SavedBytes(model.parameters(), cap_bytes)
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                loss = lm_loss(model(inputs, positions), labels)
            loss.backward()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
            saved = meter.total
        return {"saved": saved, "rss": max_rss_bytes() - rss_before, "time": statistics.median(times[1:])}
    except OverCap as over:
        return {"over_cap": over.args[0]}


def measure(cp: int, seq: int, method: str, cap_bytes: int, steps: int) -> dict:
    """The worst rank's figures (they are nearly equal: the split is balanced)."""
    per_rank = run_on_ranks(cp, rank_main, cp, seq, method, cap_bytes, steps, timeout_s=1800,
                            group_timeout_s=120 if cp > 1 else None)
    if any("over_cap" in r for r in per_rank):
        return {"over_cap": max(r.get("over_cap", 0) for r in per_rank)}
    return {key: max(r[key] for r in per_rank) for key in ("saved", "rss", "time")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    parser.add_argument("--cps", default="1,2,4")
    parser.add_argument("--method", default="ring", choices=("ring", "allgather", "ulysses"))
    parser.add_argument("--cap-mib", type=float, default=96, help="activation budget per rank (0 = none)")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    mib = 1 << 20
    cap = int(args.cap_mib * mib)
    print(f"model {MODEL}; batch 1; cp_method={args.method}; activation cap {args.cap_mib:g} MiB per rank; "
          f"torch {torch.__version__}, {os.cpu_count()} CPU cores")
    print("| seq_len | cp | activations / rank (MiB) | peak RSS growth / rank (MiB) | step time (s) |")
    print("|---:|---:|---:|---:|---:|")
    for seq in map(int, args.seqs.split(",")):
        for cp in map(int, args.cps.split(",")):
            r = measure(cp, seq, args.method, cap, args.steps)
            if "over_cap" in r:
                print(f"| {seq} | {cp} | over the cap (stopped at {r['over_cap'] / mib:.1f}) | – | – |", flush=True)
            else:
                print(f"| {seq} | {cp} | {r['saved'] / mib:.1f} | {r['rss'] / mib:.1f} | {r['time']:.2f} |",
                      flush=True)


if __name__ == "__main__":
    main()
