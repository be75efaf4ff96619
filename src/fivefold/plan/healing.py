"""Goodput with in-place healing ([ft], issue 55): torchft replica groups beside checkpoint-restart.

The planned layout's data-parallel degree is split into R = ft.replicas replica groups of dp / R
each; every group is a whole copy of the rest of the layout (tp, pp, cp, ep, ZeRO sharding inside
the group, replicated across groups: plan it as HSDP with dp_shard = dp / R so memory and
communication are the ft job's). Three mechanisms, each priced from physical quantities:

1. A group fails at its GPUs' rate, G / mtbf_gpu (G = its GPU count). The step it interrupts is
   not committed: the whole job loses one step (the work of the step up to the failure plus the
   survivors' noticing it and forming the next quorum, counted together as one step).
2. The failed group is down for D = restart_s (replacement or restart of its processes) + heal_s
   (copying weights and optimizer state from a live peer: each rank's state over its NIC). Each
   group is down a share p = rate D / (1 + rate D) of the time (it alternates up, exponential with
   mean 1 / rate, and down, D). With k groups live the job trains at k / R of its full rate:
   under ft.mode = same_batch the live groups split the fixed global batch (a step takes R / k as
   long), under shrink the step keeps its time and the batch shrinks; either way the tokens
   trained per second are k / R, so the expected share is 1 - p (independent of R at a fixed
   cluster size except through G, hence p).
3. Checkpoint-restart remains for whole-job failures: the job stops when more than
   R - ft.min_replicas groups are down at once (the quorum cannot form before a restarted group is
   back). Their rate is that of reaching that many down, from the groups' independent up/down
   states (binomial); the checkpoint interval and its goodput then follow Daly's formula
   (plan/goodput.py) at that much longer mean time between failures.

Goodput = (1 - p) x (1 - live failure rate x step) x Daly's goodput at the whole-job rate.
R = 1 (no peer to heal from) or min_replicas = R (any failure stops the quorum) is
checkpoint-restart itself. tests/test_plan_healing.py checks mechanisms 1-3 against a simulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

from fivefold.plan.layout import replaced
from fivefold.plan.memory.peak import model_state_bytes, rank_param_counts
from fivefold.plan.pipeline.schedule import pipeline_ranks

SPARES_SHOWN = 3  # the table and JSON state goodput at 0..3 spare groups (R - min_replicas)


@dataclass(frozen=True)
class Healing:
    goodput: float  # share of full-strength tokens/s the job sustains through failures
    replicas: int
    min_replicas: int
    group_mtbf_s: float  # mean time between failures of one replica group
    heal_s: float  # a restarted group's copy of state from a live peer
    job_mtbf_s: float  # mean time between whole-job failures (too many groups down at once)
    checkpoint_interval_s: float  # the best interval at that rate
    by_spares: tuple  # goodput with 0, 1, ... spare groups (R - min_replicas), this layout and R
    train_days: float
    usd: float
    kwh: float

    def to_json(self) -> dict:
        return {"goodput": self.goodput, "replicas": self.replicas, "min_replicas": self.min_replicas,
                "group_mtbf_s": self.group_mtbf_s, "heal_s": self.heal_s, "job_mtbf_s": self.job_mtbf_s,
                "checkpoint_interval_s": self.checkpoint_interval_s,
                "goodput_by_spare_groups": list(self.by_spares), "train_days": self.train_days,
                "usd": self.usd, "kwh": self.kwh}


def down_share(rate: float, down_s: float) -> float:
    """Share of time one group is down: it alternates up (exponential, mean 1 / rate) and down
    (down_s, restart and heal), a renewal process."""
    return rate * down_s / (1 + rate * down_s)


def job_failure_rate(replicas: int, min_replicas: int, rate: float, down_s: float) -> float:
    """Rate of whole-job failures: from exactly k - 1 groups down (binomial in the groups'
    independent down share), one of the R - k + 1 live ones fails, k = R - min_replicas + 1."""
    k = replicas - min_replicas + 1
    p = down_share(rate, down_s)
    return comb(replicas, k - 1) * p ** (k - 1) * (1 - p) ** (replicas - k + 1) * (replicas - k + 1) * rate


def healing_share(replicas: int, rate: float, down_s: float, step_s: float) -> float:
    """Share of full-strength training while groups fail and heal: each is live 1 - p of the time,
    and each failure of a live group (rate R (1 - p) rate) loses one step of the job."""
    p = down_share(rate, down_s)
    return (1 - p) * (1 - replicas * (1 - p) * rate * step_s)


def group_layout(layout, replicas: int):
    """One replica group's layout: dp / R, any HSDP shard group no wider than that."""
    dp = layout.dp // replicas
    return replaced(layout, dp=dp, dp_shard=layout.dp_shard if 0 < layout.dp_shard <= dp else 0)


def heal_bytes(workload, layout, replicas: int) -> float:
    """Bytes the slowest rank of a healing group copies from its counterpart: its weights and
    optimizer state (masters included) as the group holds them; gradients are not copied."""
    group = group_layout(layout, replicas)
    worst = 0.0
    for prank in pipeline_ranks(workload.stats, group, workload.seq_len):
        state = model_state_bytes(workload, group, *rank_param_counts(workload.stats, group, prank))
        worst = max(worst, state["params"] + state["optimizer"])
    return worst


def ft_problem(layout, replicas: int, min_replicas: int) -> str | None:
    """Why R groups cannot be cut from this layout, or None."""
    if layout.dp % replicas:
        return f"dp={layout.dp} is not a multiple of ft.replicas={replicas}"
    if min_replicas > replicas:
        return f"ft.min_replicas={min_replicas} is above ft.replicas={replicas}"
    group = group_layout(layout, replicas)
    if group.dp * group.cp * group.tp % layout.ep:
        return f"a group of dp={group.dp} x cp x tp cannot hold ep={layout.ep}"
    return None
