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
3. Work under tensor parallelism (`--tp-work` runs only this part). An MoE model (8 experts of
   width 512, top-2, dim 128, 4 MoE layers) trains 4 steps on one process and at tp2 (sequence
   parallel). Per step, after the first: "expert rows" = token-expert assignments the experts
   computed, summed over the ranks (counted by a forward hook on every `Experts` module: exact);
   "MoE fwd CPU" = process CPU seconds inside the MoE layers' forward, and "fwd+bwd CPU" = inside
   `Parallelized.forward_backward`, both summed over the ranks (time.process_time: CPU work, not
   wall time, so the other tenants of a shared machine move it less). Each as a ratio to the one
   process: 2.0 = every tp rank repeats the whole MoE work, 1.0 = the tp ranks split it.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from fivefold.config import MoEConfig
from fivefold.configure import load_config
from fivefold.models.moe import layer as moe_module
from spawn import run_on_ranks

STEPS = 3


def _rank(overrides: list[str]) -> tuple[float, int]:
    from fivefold.models.moe.layer import moe_layers
    from fivefold.train.trainer import train

    cfg = load_config(None, overrides)
    result = train(cfg)
    dispatchers = [m.run_experts for part in result.parallel.parts for m in moe_layers(part)]
    return sum(d.bytes_sent for d in dispatchers) / STEPS, result.records[-1]["comm_bytes"].get("ep", 0)


def volume(ep: int, seq_len: int, batch: int) -> dict:
    overrides = ["--model.preset", "tiny-moe", "--parallel.dp", str(ep), "--parallel.ep", str(ep),
                 "--train.steps", str(STEPS), "--train.seq_len", str(seq_len), "--train.global_batch",
                 str(batch), "--log.progress", "false", "--data.builtin_max_bytes", "300000"]
    got = run_on_ranks(ep, _rank, overrides, timeout_s=600, group_timeout_s=None)  # train() starts the group
    cfg = load_config(None, overrides)
    m = cfg.model
    n_moe = m.n_layers  # every layer is MoE in tiny-moe
    per_direction = (batch // ep) * seq_len * m.moe.top_k * m.dim * (ep - 1) / ep * 4 * n_moe
    return {"exact": sum(g[0] for g in got) / ep, "ledger": sum(g[1] for g in got) / ep,
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


TP_WORK_MODEL = ["--model.preset", "tiny-moe", "--model.moe.n_experts", "8", "--model.moe.expert_ffn_dim", "512",
                 "--train.seq_len", "256", "--train.global_batch", "4", "--train.steps", "4",
                 "--log.progress", "false", "--data.builtin_max_bytes", "300000"]


def _work_rank(overrides: list[str]) -> tuple[float, float, float]:
    """One rank of `tp_work`: trains, counting expert rows and CPU seconds from the second step on."""
    from fivefold.models.moe.layer import MoE, Experts
    from fivefold.parallel.parallelized import Parallelized
    from fivefold.train.trainer import train

    seen = {"steps": 0, "rows": 0, "moe_cpu": 0.0, "step_cpu": 0.0}
    moe_start: dict[int, float] = {}

    def pre(module, args):
        if seen["steps"] >= 1 and torch.is_grad_enabled():
            if isinstance(module, Experts):
                seen["rows"] += args[0].shape[0]
            elif isinstance(module, MoE):
                moe_start[id(module)] = time.process_time()

    def post(module, args, output):
        if isinstance(module, MoE) and id(module) in moe_start:
            seen["moe_cpu"] += time.process_time() - moe_start.pop(id(module))

    torch.nn.modules.module.register_module_forward_pre_hook(pre)
    torch.nn.modules.module.register_module_forward_hook(post)
    original = Parallelized.forward_backward

    def timed(self, *args, **kwargs):
        start = time.process_time()
        loss = original(self, *args, **kwargs)
        if seen["steps"] >= 1:
            seen["step_cpu"] += time.process_time() - start
        seen["steps"] += 1
        return loss

    Parallelized.forward_backward = timed
    train(load_config(None, overrides))
    n = seen["steps"] - 1
    return seen["rows"] / n, seen["moe_cpu"] / n, seen["step_cpu"] / n


def tp_work(tp: int) -> dict:
    """Per-step work summed over the ranks of a tp-only layout (tp = 1: one process)."""
    overrides = TP_WORK_MODEL + ["--parallel.tp", str(tp)]
    got = run_on_ranks(tp, _work_rank, overrides, timeout_s=900, group_timeout_s=None)  # train() starts the group
    return {"rows": sum(g[0] for g in got), "moe_cpu": sum(g[1] for g in got), "step_cpu": sum(g[2] for g in got)}


def print_tp_work() -> None:
    one, two = tp_work(1), tp_work(2)
    print("\n| layout | expert rows/step (all ranks) | MoE fwd CPU s/step | fwd+bwd CPU s/step |")
    print("|---|---|---|---|")
    for name, w in (("1 process", one), ("tp2 (sp)", two)):
        print(f"| {name} | {w['rows']:,.0f} | {w['moe_cpu']:.3f} | {w['step_cpu']:.3f} |")
    print(f"| tp2 / 1 process | {two['rows'] / one['rows']:.2f}x | {two['moe_cpu'] / one['moe_cpu']:.2f}x | "
          f"{two['step_cpu'] / one['step_cpu']:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp-work", action="store_true", help="only part 3: MoE work at tp2 against one process")
    args = parser.parse_args()
    if args.tp_work:
        print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo, fp32")
        print_tp_work()
        return
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
    print_tp_work()


if __name__ == "__main__":
    main()
