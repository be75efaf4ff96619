"""MoE: all-to-all volume of expert parallelism against b·s·k·h·(ep−1)/ep, and the grouped matmul
against the per-expert loop.

    python benchmarks/moe.py            # ~1 minute on 2 CPU cores (gloo, fp32)

1. Volume. The tiny-moe preset (4 experts, top-2, dim 128) trains 3 steps dropless with ep = dp on
   local gloo ranks. Per layer and step, a rank's dispatch sends the rows bound for other ranks'
   experts; with routing spread evenly that is b·s·k·h·(ep−1)/ep elements (b, s: the rank's
   sequences and their length), and the combine returns as much. "exact" counts the rows each
   dispatch really sent (mean over ranks and steps); "ledger" is metrics.jsonl's comm_bytes["ep"]
   (dispatch + combine, forward + backward, plus the count exchanges), compared with 4x the formula.
2. Speed. One MoE layer, forward + backward, with torch._grouped_mm and with one matmul per expert.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.multiprocessing as mp

from fivefold.config import MoEConfig, load_config
from fivefold.models import moe as moe_module

STEPS = 3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, overrides: list[str], out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from fivefold.models.moe import moe_layers
    from fivefold.train.trainer import train

    cfg = load_config(None, overrides)
    result = train(cfg)
    dispatchers = [m.run_experts for part in result.parallel.parts for m in moe_layers(part)]
    out.put((rank, sum(d.bytes_sent for d in dispatchers) / STEPS, result.records[-1]["comm_bytes"].get("ep", 0)))


def volume(ep: int, seq_len: int, batch: int) -> dict:
    overrides = ["--model.preset", "tiny-moe", "--parallel.dp", str(ep), "--parallel.ep", str(ep),
                 "--train.steps", str(STEPS), "--train.seq_len", str(seq_len), "--train.global_batch",
                 str(batch), "--log.progress", "false", "--data.builtin_max_bytes", "300000"]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, ep, port, overrides, queue)) for r in range(ep)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    cfg = load_config(None, overrides)
    m = cfg.model
    n_moe = m.n_layers  # every layer is MoE in tiny-moe
    per_direction = (batch // ep) * seq_len * m.moe.top_k * m.dim * (ep - 1) / ep * 4 * n_moe
    return {"exact": sum(g[1] for g in got) / ep, "ledger": sum(g[2] for g in got) / ep,
            "formula": per_direction}


def speed(tokens: int, dim: int, hidden: int, n_experts: int, top_k: int, repeats: int = 5) -> dict:
    torch.manual_seed(0)
    layer = moe_module.MoE(dim, hidden, MoEConfig(n_experts=n_experts, top_k=top_k))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, tokens, dim)
    times = {}
    for grouped in (True, False):
        moe_module.GROUPED_MM_ENABLED = grouped
        layer(x).sum().backward()  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            layer(x).sum().backward()
        times["grouped" if grouped else "loop"] = (time.perf_counter() - start) / repeats
    moe_module.GROUPED_MM_ENABLED = True
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo, fp32\n")
    print("| ep (= dp) | b·s per rank | dispatch bytes/rank/step exact | formula b·s·k·h·(ep−1)/ep | ratio "
          "| ledger ep bytes | 4x formula | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for ep, seq_len, batch in ((2, 128, 8), (4, 128, 8)):
        v = volume(ep, seq_len, batch)
        print(f"| {ep} | {batch // ep}·{seq_len} | {v['exact']:,.0f} | {v['formula']:,.0f} | "
              f"{v['exact'] / v['formula']:.3f} | {v['ledger']:,.0f} | {4 * v['formula']:,.0f} | "
              f"{v['ledger'] / (4 * v['formula']):.3f} |", flush=True)
    print("\n| MoE layer (tokens, dim, hidden, experts, top-k) | grouped mm fwd+bwd | per-expert loop | speed-up |")
    print("|---|---|---|---|")
    torch.set_num_threads(1)
    for shape in ((4096, 256, 512, 8, 2), (4096, 256, 512, 32, 4), (2048, 512, 1024, 64, 6)):
        t = speed(*shape)
        print(f"| {shape} | {t['grouped'] * 1e3:.1f} ms | {t['loop'] * 1e3:.1f} ms | {t['loop'] / t['grouped']:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
