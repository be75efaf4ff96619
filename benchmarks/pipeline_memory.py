"""Pipeline activation memory: each pipeline rank's measured peak against the planner, per schedule.

    OMP_NUM_THREADS=1 python benchmarks/pipeline_memory.py            # pp 2 and 4, every schedule
    python benchmarks/pipeline_memory.py --pps 2 --schedules 1f1b,zbv --dtype bf16 --recompute selective

For each (pp, schedule) the script starts pp local gloo ranks, builds a small Llama-style model
(dim 64, 4 heads, 2 KV heads, ffn 128, 2 layers per rank: every stage of a two-chunk schedule holds
one), and runs one real step of the schedule over 8 micro-batches of one 256-token sequence.
train/pipeline_probe.py records, after every forward, loss and backward action of the rank, the
bytes of the saved activations it holds (storages its forwards created that something still
references, and the received inputs of its in-flight micro-batches); the largest is the measured
peak. Beside it: the planner's `rank_memory(...).activations` for that pipeline rank (plan/memory/peak.py)
and the micro-batches it counts in flight per chunk (plan/pipeline/schedule.py in_flight_per_chunk).
"""

from __future__ import annotations

import argparse

import torch

from spawn import run_on_ranks

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb", "zbv", "dualpipev")


def overrides(pp: int, schedule: str, dtype: str, recompute: str) -> dict:
    return {"model": {"dim": 64, "n_layers": 2 * pp, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128},
            "parallel": {"pp": pp, "pp_schedule": schedule,
                         "pp_virtual": 1 if schedule in ("gpipe", "1f1b") else 2},
            "train": {"seq_len": 256, "micro_batch": 1, "global_batch": 8, "dtype": dtype,
                      "recompute": recompute},
            "data": {"builtin_max_bytes": 200_000}, "log": {"progress": False}}


def predicted(cfg) -> list[tuple[float, tuple[int, ...]]]:
    """(activation bytes, micro-batches in flight per chunk) of each pipeline rank."""
    from fivefold.plan import DEFAULT_RUNTIME, hardware_for
    from fivefold.plan.layout import layout_from_config
    from fivefold.plan.memory.peak import rank_memory
    from fivefold.plan.pipeline.schedule import in_flight_per_chunk, pipeline_ranks
    from fivefold.plan.workload import workload_from_config

    workload, layout, hw = workload_from_config(cfg), layout_from_config(cfg), hardware_for("cpu", 8)
    m = layout.micro_batches(workload.global_batch)
    return [(rank_memory(workload, layout, hw, DEFAULT_RUNTIME, prank, r).activations,
             in_flight_per_chunk(layout, r, m))
            for r, prank in enumerate(pipeline_ranks(workload.stats, layout, workload.seq_len))]


def _measure(cfg) -> tuple[int, int]:
    from fivefold.config import micro_batches
    from fivefold.train.pipeline_probe import pipeline_peak_bytes
    from fivefold.train.trainer import autocast, setup

    rt, par = setup(cfg)
    batch = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.train.seq_len + 1),
                          generator=torch.Generator().manual_seed(0))
    peak, _ = pipeline_peak_bytes(par, batch, micro_batches(cfg), lambda: autocast(cfg, rt.device))
    return par.pipeline.pp_rank, peak


def measure(cfg) -> dict[int, int]:
    """pipeline rank -> measured peak bytes, from pp fresh local processes."""
    return dict(run_on_ranks(cfg.parallel.pp, _measure, cfg, timeout_s=1200, group_timeout_s=600))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pps", default="2,4")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    args = parser.parse_args()
    from fivefold.configure import load_config

    print("| pp | schedule | rank | in flight per chunk | measured MiB | predicted MiB | predicted/measured |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for pp in (int(x) for x in args.pps.split(",")):
        for schedule in args.schedules.split(","):
            cfg = load_config(None, overrides(pp, schedule, args.dtype, args.recompute))
            got = measure(cfg)
            for rank, (bytes_, counts) in enumerate(predicted(cfg)):
                ratio = bytes_ / got[rank]
                worst = max(worst, abs(ratio - 1))
                print(f"| {pp} | {schedule} | {rank} | {counts} | {got[rank] / 2**20:.2f} | "
                      f"{bytes_ / 2**20:.2f} | {ratio:.3f} |", flush=True)
    print(f"\nlargest error: {worst:.1%} ({args.dtype}, recompute={args.recompute})")


if __name__ == "__main__":
    main()
