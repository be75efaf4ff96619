"""`fivefold layout CONFIG --build --rank R`: build one rank's real shard of a layout of any size
in this one process, and say what it holds next to what the planner predicts.

The process joins a fake process group of the config's whole world size (PyTorch's `fake`
backend: every collective returns at once, nothing is sent), so the trainer's own construction
runs exactly as it would on rank R of the cluster: the meta-device model is split, laid out and
sharded, then rank R's pieces are materialised and initialised. Gradients and AdamW moments are
allocated by the first training step; their bytes are counted from the tensors the optimizer
will update (parameters, or ZeRO-1/2's chunks: two AdamW moments, or Muon's one momentum), not
allocated here.
"""

from __future__ import annotations

import resource
import time

import torch
import torch.distributed as dist

from fivefold.config import Config
from fivefold.parallel.grad_norm import local_tensor
from fivefold.torch_internals import fake_store_class


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _bytes(tensors) -> int:
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)


def held_state_bytes(par) -> dict[str, int]:
    """Parameters (and ZeRO-1/2 master chunks) this rank holds now, and the gradient and optimizer
    bytes it will hold once training runs, from the tensors each data-parallel variant keeps."""
    dp = par.data_parallel
    params = _bytes(dp.params)  # the trained ones: gradients and optimizer state follow them
    held = _bytes({id(p): p for part in dp.parts for p in part.parameters()}.values())  # a frozen base too (LoRA)
    targets = dp.build_optimizer(list)  # what the optimizer updates: local parameters, or fp32 master chunks
    # AdamW keeps two moments of each, Muon (its matrices, train.optimizer = muon) one momentum.
    moments = sum((1 if getattr(dp.settings_of(t), "optimizer", "") == "muon" else 2) * _bytes([t]) for t in targets)
    chunks = _bytes(getattr(dp, "chunks", []))
    if getattr(dp, "main_grads", False):  # bf16: whole fp32 gradient buffers; chunk gradients view them
        grads = 4 * sum(bucket.padded for bucket in dp.buckets)
    elif chunks:  # fp32 zero 1/2: masters held now; zero 1 keeps whole gradients beside its chunk's
        grads = chunks + (0 if dp.shard_grads else params)
    else:  # gradients in the parameters' dtype (FSDP2: fp32 shards)
        grads = params
    return {"param_bytes": held, "grad_bytes": grads, "optimizer_bytes": moments + chunks,
            "resident_bytes": held + chunks}


def planned_state_bytes(cfg: Config, rank: int) -> dict[str, int]:
    from fivefold.mesh import ParallelDims
    from fivefold.plan.layout import layout_from_config
    from fivefold.plan.memory.peak import master_chunk_bytes, model_state_bytes, muon_param_counts, rank_param_counts
    from fivefold.plan.pipeline.schedule import pipeline_ranks
    from fivefold.plan.workload import workload_from_config

    workload, layout = workload_from_config(cfg), layout_from_config(cfg)
    prank = pipeline_ranks(workload.stats, layout, cfg.train.seq_len)[
        ParallelDims.from_config(cfg.parallel).coordinates(rank)["pp"]]
    counts = rank_param_counts(workload.stats, layout, prank)
    muon = muon_param_counts(workload.stats, layout, prank) if workload.muon else (0.0, 0.0)
    state = model_state_bytes(workload, layout, *counts, muon)
    resident = state["params"] + master_chunk_bytes(workload, layout, *counts)
    return {f"planned_{k}_bytes": int(round(v)) for k, v in
            (("param", state["params"]), ("grad", state["grads"]), ("optimizer", state["optimizer"]),
             ("resident", resident))}


def build_rank(cfg: Config, rank: int) -> dict:
    """Construct rank `rank` of the config's layout here; the report of what it holds."""
    from fivefold.mesh import ParallelDims
    from fivefold.models import build_meta_model, initial_values
    from fivefold.models.lora.adapters import adapter_initial_values
    from fivefold.parallel.parallelize import parallelize

    store_class = fake_store_class()  # imports torch.testing._internal: only here

    dims = ParallelDims.from_config(cfg.parallel)
    baseline = peak_rss_bytes()
    start = time.perf_counter()
    dist.init_process_group("fake", store=store_class(), rank=rank, world_size=dims.world_size)
    try:
        fill = initial_values(cfg.model, cfg.train.seed)
        par = parallelize(build_meta_model(cfg.model, cfg.lora), dims, cfg, torch.device("cpu"),
                          adapter_initial_values(fill, cfg.train.seed) if cfg.lora.rank else fill)
        seconds = time.perf_counter() - start
        held = held_state_bytes(par)
    finally:
        dist.destroy_process_group()
    return {"rank": rank, "world_size": dims.world_size, **held, "peak_rss_bytes": peak_rss_bytes(),
            "baseline_rss_bytes": baseline, "seconds": round(seconds, 2), **planned_state_bytes(cfg, rank)}


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def format_report(report: dict) -> str:
    lines = [f"rank {report['rank']} of {report['world_size']}: built in {report['seconds']:.1f} s, "
             f"peak RSS {_size(report['peak_rss_bytes'])} (process before building "
             f"{_size(report['baseline_rss_bytes'])})"]
    for kind in ("param", "grad", "optimizer"):
        held, planned = report[f"{kind}_bytes"], report[f"planned_{kind}_bytes"]
        ratio = f"{held / planned:.4f}" if planned else "-"
        verb = "holds" if kind == "param" else "will hold"
        lines.append(f"  {kind:9s} {verb:9s} {_size(held):>10s}   planner {_size(planned):>10s}   ratio {ratio}")
    return "\n".join(lines)
