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

import dataclasses
import math
from dataclasses import dataclass

from fivefold.plan import healing as heal
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
    healing: heal.Healing | None = None  # with in-place healing, under ft.replicas (plan/healing.py)
    problem: str = ""  # why the layout cannot be cut into ft.replicas groups

    def to_json(self) -> dict:
        out = {"goodput": self.goodput, "checkpoint_interval_s": self.checkpoint_interval_s,
               "train_days": self.train_days, "usd": self.usd, "kwh": self.kwh}
        if self.healing or self.problem:  # only under ft.replicas: the JSON contract is unchanged without
            out["healing"] = self.healing.to_json() if self.healing else {"problem": self.problem}
        return out


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


def restart_goodput(rate: float, delta: float, recover: float) -> tuple[float, float, float]:
    """(goodput, MTBF, best checkpoint interval) of checkpoint-restart at failure rate `rate`
    (1/s); no failures at all: goodput 1 and no checkpoints needed."""
    if rate <= 0:
        return 1.0, math.inf, math.inf
    tau = best_interval(delta, 1 / rate, recover)
    return goodput_at(tau, delta, 1 / rate, recover), 1 / rate, tau


def healing_goodput(replicas: int, min_replicas: int, group_rate: float, step_s: float, restart: float,
                    heal_s: float, delta: float) -> tuple[float, float, float]:
    """(goodput, whole-job MTBF, checkpoint interval) with R replica groups healing in place, each
    failing at group_rate (plan/healing.py). R = 1 has no peer to heal from and min_replicas = R
    stops at any failure: both are checkpoint-restart at the job's rate."""
    recover = restart + delta  # a whole-job failure: restart, then read the checkpoint back
    if replicas <= 1 or min_replicas >= replicas:
        return restart_goodput(replicas * group_rate, delta, recover)
    down = restart + heal_s  # a group is down from its failure until it has healed
    share = heal.healing_share(replicas, group_rate, down, step_s)
    whole, mtbf, tau = restart_goodput(heal.job_failure_rate(replicas, min_replicas, group_rate, down),
                                       delta, recover)
    return share * whole, mtbf, tau


def goodput(workload, layout, hw, step_time_s: float, steps: int, cluster=None, ft=None) -> Goodput:
    """Checkpoint-restart's goodput and cost; under ft.replicas > 0 in-place healing's beside it."""
    n = layout.world_size
    nodes = max(1.0, n / hw.gpus_per_node)
    gpu_mtbf = cluster_value(cluster, "mtbf_gpu_hours", DEFAULTS["mtbf_gpu_hours"]) * 3600
    mtbf = gpu_mtbf / n
    storage = cluster_value(cluster, "storage_gbps", DEFAULTS["storage_gbps"]) * GB
    delta = checkpoint_bytes(workload, layout) / nodes / storage  # every node writes its share at once
    restart = cluster_value(cluster, "restart_s", DEFAULTS["restart_s"])
    recover = restart + delta  # restart, then read back
    tau = best_interval(delta, mtbf, recover)
    share = goodput_at(tau, delta, mtbf, recover)
    days, usd, kwh = _cost(cluster, hw, n, steps * step_time_s / share)
    out = Goodput(goodput=share, checkpoint_interval_s=tau, checkpoint_s=delta, job_mtbf_s=mtbf,
                  train_days=days, usd=usd, kwh=kwh)
    if ft is None or ft.replicas < 1:
        return out
    problem = heal.ft_problem(layout, ft.replicas, ft.min_replicas)
    if problem:
        return dataclasses.replace(out, problem=problem)
    r = ft.replicas
    group_rate = n / r / gpu_mtbf  # the group's GPUs, each failing at 1 / gpu_mtbf
    heal_s = heal.heal_bytes(workload, layout, r) / hw.nic_bw  # rank to rank across nodes, one NIC each
    by_spares = tuple(healing_goodput(r, r - s, group_rate, step_time_s, restart, heal_s, delta)[0]
                      for s in range(min(r - 1, heal.SPARES_SHOWN) + 1))
    g, job_mtbf, job_tau = healing_goodput(r, ft.min_replicas, group_rate, step_time_s, restart, heal_s, delta)
    days, usd, kwh = _cost(cluster, hw, n, steps * step_time_s / g)
    return dataclasses.replace(out, healing=heal.Healing(
        goodput=g, replicas=r, min_replicas=ft.min_replicas, group_mtbf_s=1 / group_rate, heal_s=heal_s,
        job_mtbf_s=job_mtbf, checkpoint_interval_s=job_tau, by_spares=by_spares, train_days=days, usd=usd,
        kwh=kwh))


def _cost(cluster, hw, n: int, wall_s: float) -> tuple[float, float, float]:
    """(days, dollars, kWh) of n GPUs for wall_s seconds."""
    hours = wall_s / 3600
    price = cluster_value(cluster, "usd_per_gpu_hour", DEFAULTS["usd_per_gpu_hour"])
    watts = cluster_value(cluster, "watts_per_gpu", hw.board_watts)
    return hours / 24, hours * n * price, hours * n * watts / 1000
