"""`fivefold train ... --parallel.auto true` (or `--parallel.pp auto`, one key at a time): the
planner chooses the layout keys left to it, for the job's world size and the device the ranks run
on, and the trainer then trains exactly that layout.

Pure: no torch, no processes. The command line (fivefold.cli) strips the auto values from the
overrides (split_auto), asks `choose` for the fastest layout that the training code's own rules
accept, prints `describe`, and hands the choice back as ordinary overrides (as_overrides), so a
worker rank loads the same config a hand-written layout would give it.

The enumeration is the search's own (plan/search.py candidate_layouts: the same degrees, micro-batch
sizes, schedules, ZeRO stages and recomputation, in the same order), given the keys the user fixed,
which keep the user's values instead of taking the search's options; with every key free, the
choice is the search's top pick among the layouts fivefold.configure.validate accepts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fivefold.config import CheckpointConfig, Config, ConfigError, DataConfig, parse_overrides
from fivefold.plan.estimate import Estimate, estimate
from fivefold.plan.hardware import PROFILES, Hardware, Runtime, hardware_for, hardware_from_cluster
from fivefold.plan.layout import Layout, config_with_layout
from fivefold.plan.memory.peak import worst_rank_memory
from fivefold.plan.search import (candidate_layouts, divisors, explain, field_options, layout_problem, memory_reason,
                                  rank)
from fivefold.plan.workload import workload_from_config
from fivefold.configure import validate

GB = 1e9
# The keys a user may leave to the planner -> the Layout field each one sets.
AUTO_KEYS = {"parallel.dp": "dp", "parallel.tp": "tp", "parallel.pp": "pp", "parallel.cp": "cp",
             "parallel.ep": "ep", "parallel.zero": "zero", "parallel.pp_schedule": "pp_schedule",
             "parallel.pp_virtual": "pp_virtual", "parallel.sp": "sp", "train.micro_batch": "mbs",
             "train.recompute": "recompute"}
_FIELD_KEYS = {f: k for k, f in AUTO_KEYS.items()}
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")  # config/schema.py's booleans


# ----------------------------------------------------------------------------- the command line

def _pairs(overrides: list[str]):
    """(start index, tokens used, dotted key, value) of each `--a.b v` / `--a.b=v` override; what
    is not one is left for config.parse_overrides to explain."""
    i = 0
    while i < len(overrides):
        arg = overrides[i]
        if arg.startswith("--") and "=" in arg:
            key, value = arg[2:].split("=", 1)
            yield i, 1, key, value
            i += 1
        elif arg.startswith("--") and i + 1 < len(overrides):
            yield i, 2, arg[2:], overrides[i + 1]
            i += 2
        else:
            i += 1


def split_auto(overrides: list[str]) -> tuple[list[str], frozenset[str]]:
    """The overrides without `--parallel.auto X` and `--KEY auto`, and the Layout fields the
    planner is to choose: every auto key not on the command line for `--parallel.auto true`,
    or just the keys given the value `auto`."""
    free, all_auto, drop = set(), False, set()
    for i, used, key, value in _pairs(overrides):
        word = value.strip().lower()
        if key == "parallel.auto":
            if word not in _TRUE + _FALSE:
                raise ConfigError(f"--parallel.auto must be true or false, got '{value}' (true lets the "
                                  "planner choose the layout; or give single keys the value auto, e.g. "
                                  "--parallel.pp auto)")
            all_auto = all_auto or word in _TRUE
            drop.update(range(i, i + used))
        elif word == "auto" and key in AUTO_KEYS:
            free.add(AUTO_KEYS[key])
            drop.update(range(i, i + used))
    rest = [arg for i, arg in enumerate(overrides) if i not in drop]
    if all_auto:
        given = parse_overrides(rest)
        pinned = {f for k, f in AUTO_KEYS.items() if k.split(".")[1] in given.get(k.split(".")[0], {})}
        free |= set(AUTO_KEYS.values()) - pinned
    if "pp_schedule" in free and "parallel.pp_virtual" not in _given_keys(rest):
        free.add("pp_virtual")  # a schedule brings its own stages per rank (the V schedules: 2)
    return rest, frozenset(free)


def _given_keys(overrides: list[str]) -> set[str]:
    return {key for _, _, key, _ in _pairs(overrides)}


def as_overrides(layout: Layout, free: frozenset[str]) -> list[str]:
    """The chosen values of the free keys, as command-line overrides (which a user may also
    paste to train the same layout without the planner)."""
    out = []
    for key, name in AUTO_KEYS.items():
        if name in free:
            out += [f"--{key}", str(getattr(layout, name))]
    return out


def job_hardware(cfg: Config, gpus_per_node: int, device_name: str | None) -> tuple[Hardware, str]:
    """The profile the ranks run on and why: the CPU profile without CUDA; else the profile named
    in the CUDA device's name ("NVIDIA H100 80GB HBM3" -> h100), or cluster.gpu's for a device
    the profiles do not know. [cluster] figures (memory_gb, ...) apply to the cluster.gpu profile."""
    if device_name is None:
        name, why = "cpu", "no CUDA device: the CPU profile, one process per rank"
    else:
        known = [key for key in PROFILES if key != "cpu" and key in device_name.lower()]
        name = known[0] if known else cfg.cluster.gpu
        why = f"{device_name}" if known else f"{device_name} is not profiled: cluster.gpu={cfg.cluster.gpu}"
    if name == cfg.cluster.gpu.strip().lower():
        hw = dataclasses.replace(hardware_from_cluster(cfg.cluster), gpus_per_node=gpus_per_node)
    else:
        hw = hardware_for(name, gpus_per_node)
    return hw, why


# ------------------------------------------------------------------------------------ choosing

@dataclass
class Choice:
    best: Estimate
    valid: list[Estimate]  # the first layouts that fit and that the training code accepts, best first
    world: int
    hardware: Hardware
    free: frozenset[str]
    n_fitting: int = 0  # layouts the planner found to fit, before the training code's full rules

    @property
    def runner_up(self) -> Estimate | None:
        return self.valid[1] if len(self.valid) > 1 else None

    @property
    def other_degrees(self) -> Estimate | None:
        """The best layout with other parallel degrees (the runner-up is often a twin of the best
        that differs in micro-batch size or ZeRO stage only)."""
        return next((e for e in self.valid if _degrees_of(e) != _degrees_of(self.best)), None)


def _degrees_of(est: Estimate) -> tuple:
    return est.layout.dp, est.layout.tp, est.layout.pp, est.layout.cp, est.layout.ep


def _fixed(free: frozenset[str], base: Layout) -> dict:
    """The Layout fields the planner is not to choose, with the values the config gives them
    (plan/search.py candidate_layouts keeps them instead of taking the search's options)."""
    return {name: getattr(base, name) for name in AUTO_KEYS.values() if name not in free}


def _base(cfg: Config) -> Layout:
    p, t = cfg.parallel, cfg.train
    return Layout(dp=p.dp, zero=p.zero, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, mbs=t.micro_batch,
                  recompute=t.recompute, pp_schedule=p.pp_schedule, pp_virtual=p.pp_virtual,
                  dp_shard=p.dp_shard, sp=p.sp, cp_method=p.cp_method, pp_layers=p.pp_layers)


def planning_config(cfg: Config) -> Config:
    """The layout does not depend on data or checkpoint paths: their problems are reported by the
    launch's own validation, not as 'no valid layout'."""
    return dataclasses.replace(cfg, data=DataConfig(), checkpoint=CheckpointConfig())


def choose(cfg: Config, world: int, hw: Hardware, runtime: Runtime, free: frozenset[str],
           check=None, keep: int = 2) -> Choice:
    """The fastest layout of `world` ranks on `hw` that fits and that the training code accepts
    (fivefold.configure.validate, then `check(config)` for this machine's rules, e.g. configure/machine.py's check_machine), with
    at least the next `keep - 1` valid ones and the best of other degrees (Choice.valid).
    Raises ConfigError with the reason when there is none."""
    cfg = planning_config(cfg)
    if "pp" in free and not cfg.train.micro_batch:
        # train.micro_batch unset (0: the whole per-rank batch) leaves a pipeline one micro-batch
        # per step, which no schedule can fill: choosing pp chooses the micro-batch size with it.
        free = free | {"mbs"}
    workload = workload_from_config(cfg)
    base = _base(cfg)
    fitting, leanest, problems = [], None, []
    for grid in candidate_layouts(cfg, workload, world, hw.gpus_per_node, _fixed(free, base), base):
        first = grid.first
        problem = layout_problem(cfg, workload, first, world, full_check=False)
        if problem:
            problems.append((first, problem))
            continue
        settled: set[int] = set()  # ZeRO stages that fit with cheaper recomputation (search.py)
        for layout in grid.cheapest(settled):
            mem = worst_rank_memory(workload, layout, hw, runtime)
            if mem.total > hw.memory_bytes:
                if leanest is None or mem.total < leanest[1].total:
                    leanest = (layout, mem)
                continue
            fitting.append(estimate(workload, layout, hw, runtime, mem))
            settled.add(layout.zero)
    rank(fitting)
    valid = []
    for est in fitting:  # the search's winners, re-checked with the training code's full rules
        problem = _training_problem(cfg, est.layout, world, check)
        if problem:
            problems.append((est.layout, problem))
            continue
        valid.append(est)
        # Enough to print and sweep: the full rules take milliseconds per layout, and a large
        # cluster has hundreds that fit.
        if len(valid) >= max(keep, 2) and _degrees_of(valid[0]) != _degrees_of(est):
            break
    if not valid:
        raise ConfigError(_nothing_valid(cfg, world, hw, free, base, problems, leanest))
    explain(valid)
    return Choice(best=valid[0], valid=valid, world=world, hardware=hw, free=free, n_fitting=len(fitting))


def _training_problem(cfg: Config, layout: Layout, world: int, check) -> str | None:
    try:
        layout_cfg = validate(config_with_layout(cfg, layout), world)
        if check is not None:
            check(layout_cfg)
    except ConfigError as err:
        return str(err)
    return None


def _nothing_valid(cfg, world, hw, free, base, problems, leanest) -> str:
    m, t = cfg.model, cfg.train
    shape = (f"{m.preset or 'the model'} ({m.n_layers} layers, {m.n_heads} heads, {m.n_kv_heads} kv heads, "
             f"train.global_batch={t.global_batch}, train.seq_len={t.seq_len})")
    fixed = ", ".join(f"{_FIELD_KEYS[f]}={getattr(base, f)}" for f in ("dp", "tp", "pp", "cp", "ep")
                      if f not in free)
    fixed = f" with {fixed} as given" if fixed else ""
    if leanest is not None:  # some layouts are valid but none fits: memory is the reason
        return (f"--parallel.auto: no layout of {shape} on {world} ranks{fixed} fits the {hw.name} "
                f"profile's {hw.memory_bytes / GB:.0f} GB per rank: the leanest, {leanest[0].short()}, "
                f"{memory_reason(leanest[1], hw.memory_bytes)}; use more ranks")
    if not problems:
        problems = _degree_problems(cfg, world, free, base)
    # The first two different reasons, each with a layout it rejects.
    first = {}
    for layout, reason in problems:
        first.setdefault(reason, f"{_degrees_text(layout)}: {reason}")
    reasons = list(first.values())[:2]
    why = "; ".join(reasons) if reasons else f"no product dp*tp*pp*cp of the free degrees makes {world}"

    return (f"--parallel.auto found no valid layout of {shape} on {world} ranks{fixed} ({why}); "
            "change --nproc, train.global_batch or the fixed keys")


def _degree_problems(cfg: Config, world: int, free: frozenset[str], base: Layout) -> list:
    """Why each split of `world` into dp*tp*pp*cp (the fixed degrees kept) fails the validator:
    the search's own options were all pruned, so say what the training code's rules say."""
    out, fixed = [], _fixed(free, base)
    for tp in field_options("tp", fixed, divisors(world)):
        for cp in field_options("cp", fixed, divisors(world)):
            for pp in field_options("pp", fixed, divisors(world)):
                dp = world // (tp * cp * pp) if world % (tp * cp * pp) == 0 else 0
                if not dp or fixed.get("dp", dp) != dp:
                    continue
                layout = dataclasses.replace(base, dp=dp, tp=tp, pp=pp, cp=cp, ep=fixed.get("ep", 1),
                                             mbs=fixed.get("mbs", 1))
                problem = _training_problem(cfg, layout, world, None)
                if problem:
                    out.append((layout, problem))
    return out


def _degrees_text(layout: Layout) -> str:
    return " ".join(f"{k}{getattr(layout, k)}" for k in ("dp", "tp", "pp", "cp", "ep"))


# -------------------------------------------------------------------------------------- printing

def describe(choice: Choice, hardware_why: str) -> str:
    """What was chosen, the runner-up, why, and the same layout as overrides (a few lines)."""
    best, hw = choice.best, choice.hardware
    lines = [f"auto layout for {choice.world} ranks on {hw.name} ({hardware_why}; {hw.gpus_per_node} per node): "
             f"{best.layout.short()}",
             f"  predicted {best.tokens_per_sec_per_gpu:,.0f} tokens/s per rank, "
             f"{best.memory.total / GB:.2f} GB per rank; best of {choice.n_fitting} layouts that fit"]
    if choice.runner_up is not None:
        lines.append(f"  runner-up: {choice.runner_up.layout.short()} ({choice.runner_up.tokens_per_sec_per_gpu:,.0f} "
                     "tokens/s per rank)")
    lines.append(f"  why: {best.why}")
    other = choice.other_degrees
    if other is not None and other is not choice.runner_up:
        lines.append(f"  best with other degrees: {other.layout.short()}: {other.why}")
    lines.append("  by hand: " + " ".join(as_overrides(best.layout, choice.free)))
    return "\n".join(lines)


def sweep_config(cfg: Config) -> Config:
    """The config the sweep's short runs train: they must neither save into nor resume from the
    real run's checkpoints (plan/sweep.py moves only the metrics into a temporary folder)."""
    return dataclasses.replace(cfg, checkpoint=CheckpointConfig())


def keep_fastest(measured: list[tuple[Estimate, dict]]) -> tuple[Estimate, str]:
    """The measured layout with the most tokens/s per rank, and a table of what each measured."""
    rows = ["| # | layout | predicted tok/s/rank | measured tok/s/rank |", "|---|---|---|---|"]
    ok = []
    for i, (est, got) in enumerate(measured, 1):
        if "error" in got:
            rows.append(f"| {i} | {est.layout.short()} | {est.tokens_per_sec_per_gpu:,.0f} | failed: {got['error']} |")
            continue
        ok.append((got["tokens_per_sec_per_gpu"], i, est))
        rows.append(f"| {i} | {est.layout.short()} | {est.tokens_per_sec_per_gpu:,.0f} | "
                    f"{got['tokens_per_sec_per_gpu']:,.0f} |")
    if not ok:
        raise ConfigError(f"--sweep: none of the {len(measured)} layouts trained on this machine (the "
                          f"first said: {measured[0][1]['error']}); run without --sweep to see the error")
    speed, i, est = max(ok, key=lambda item: (item[0], -item[1]))
    kept = f"kept #{i}, {est.layout.short()}: the fastest measured ({speed:,.0f} tokens/s per rank)"
    return est, "\n".join([*rows, kept])
