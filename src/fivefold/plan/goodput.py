"""Goodput and cost of a layout: how much of the wall time trains once GPUs fail, the checkpoint
interval that makes it most, and the days, dollars and kilowatt-hours of `train.steps` steps.

Failures arrive at random (a Poisson process) at the job's rate n_gpus / mtbf_gpu_hours. Work is
saved every tau seconds of training by a checkpoint that takes delta = bytes per node / storage
bandwidth per node; a failure loses the work since the last checkpoint and costs restart_s plus
reading the checkpoint back (the same bytes at the same bandwidth). With M the job's mean time
between failures and R the time to train again after one, the expected wall time of one segment
of tau seconds of training plus its checkpoint is (Daly 2006, "A higher order estimate of the
optimum checkpoint interval for restart dumps", with failures also during restart)
    E[T] = M e^(R/M) (e^((tau + delta)/M) - 1)
and the goodput, the share of wall time that trains, is tau / E[T]. The interval that maximises
it is found numerically; for delta << M it is Young's sqrt(2 delta M) (Young 1974), Daly's
higher-order estimate beside it (daly_interval).

Defaults (each a [cluster] key, DESIGN.md):
  mtbf_gpu_hours 50,700: the Llama 3 report (Llama Team 2024, s3.3.4): 419 unexpected
      interruptions in 54 days of 16,384 H100s (16,384 x 54 x 24 / 419 GPU-hours);
  restart_s 600: rescheduling, process start and NCCL setup at thousands of GPUs take minutes
      (an assumption: the report gives no figure);
  storage_gbps 1.0 GB/s per node: the Llama 3 cluster's Tectonic sustained 2 TB/s for 2,048
      nodes (s3.1.1);
  usd_per_gpu_hour 2.0 (an assumption: a reserved H100-class cloud price, 2025);
  watts_per_gpu: the GPU's board power (Hardware.board_watts; the node's CPUs, fans and network add
      to it, and a datacenter's PUE on top: not counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fivefold.plan.memory.peak import rank_param_counts
from fivefold.plan.pipeline.schedule import pipeline_ranks

DEFAULTS = {"mtbf_gpu_hours": 16384 * 54 * 24 / 419, "restart_s": 600.0, "storage_gbps": 1.0,
            "usd_per_gpu_hour": 2.0}
GB = 1e9


@dataclass(frozen=True)
class Goodput:
    goodput: float  # share of wall time that trains
    checkpoint_interval_s: float  # training seconds between checkpoints that maximise it
    checkpoint_s: float  # one checkpoint's write (and read) time
    job_mtbf_s: float
    train_days: float
    usd: float
    kwh: float

    def to_json(self) -> dict:
        return {"goodput": self.goodput, "checkpoint_interval_s": self.checkpoint_interval_s,
                "train_days": self.train_days, "usd": self.usd, "kwh": self.kwh}


def segment_seconds(tau: float, delta: float, mtbf: float, recover: float) -> float:
    """Expected wall time to finish tau seconds of training and its checkpoint (delta), failures
    arriving at rate 1/mtbf and each costing `recover` (restart and checkpoint read) plus the lost
    work (Daly 2006)."""
    return mtbf * math.exp(recover / mtbf) * math.expm1((tau + delta) / mtbf)


def goodput_at(tau: float, delta: float, mtbf: float, recover: float) -> float:
    return tau / segment_seconds(tau, delta, mtbf, recover)


def best_interval(delta: float, mtbf: float, recover: float) -> float:
    """The interval maximising goodput_at (unimodal in log tau: golden-section search)."""
    lo, hi = math.log(max(1e-3, delta * 1e-3)), math.log(50 * mtbf)
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = (goodput_at(math.exp(x), delta, mtbf, recover) for x in (a, b))
    for _ in range(100):
        if fa > fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = goodput_at(math.exp(a), delta, mtbf, recover)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = goodput_at(math.exp(b), delta, mtbf, recover)
    return math.exp((lo + hi) / 2)


def young_interval(delta: float, mtbf: float) -> float:
    return math.sqrt(2 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order estimate (2006), for delta < 2 mtbf."""
    x = delta / (2 * mtbf)
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - delta


def checkpoint_bytes(workload, layout) -> float:
    """Bytes the whole job saves per checkpoint: each weight once (not per data-parallel replica),
    in the weights' dtype, with its optimizer state and fp32 master (the precision recipe);
    gradients are not saved."""
    pr, stats = workload.precision, workload.stats
    ranks = pipeline_ranks(stats, layout, workload.seq_len)
    dense = sum(rank_param_counts(stats, layout, p)[0] for p in ranks) * layout.tp
    experts = sum(rank_param_counts(stats, layout, p)[1] for p in ranks) * layout.ep
    return (dense + experts) * (pr.param_bytes + pr.optim_bytes + pr.master_bytes + pr.shard_master_bytes)


def cluster_value(cluster, key: str, fallback: float) -> float:
    """A [cluster] key's value, or its default where the config leaves it 0 or does not have it."""
    value = getattr(cluster, key, 0) if cluster is not None else 0
    return float(value) if value else float(fallback)


def goodput(workload, layout, hw, step_time_s: float, steps: int, cluster=None) -> Goodput:
    n = layout.world_size
    nodes = max(1.0, n / hw.gpus_per_node)
    mtbf = cluster_value(cluster, "mtbf_gpu_hours", DEFAULTS["mtbf_gpu_hours"]) * 3600 / n
    storage = cluster_value(cluster, "storage_gbps", DEFAULTS["storage_gbps"]) * GB
    delta = checkpoint_bytes(workload, layout) / nodes / storage  # every node writes its share at once
    recover = cluster_value(cluster, "restart_s", DEFAULTS["restart_s"]) + delta  # restart, then read back
    tau = best_interval(delta, mtbf, recover)
    share = goodput_at(tau, delta, mtbf, recover)
    hours = steps * step_time_s / share / 3600
    price = cluster_value(cluster, "usd_per_gpu_hour", DEFAULTS["usd_per_gpu_hour"])
    watts = cluster_value(cluster, "watts_per_gpu", hw.board_watts)
    return Goodput(goodput=share, checkpoint_interval_s=tau, checkpoint_s=delta, job_mtbf_s=mtbf,
                   train_days=hours / 24, usd=hours * n * price, kwh=hours * n * watts / 1000)
