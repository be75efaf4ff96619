"""`fivefold plan [CONFIG] [--layout ... | --layouts FILE.jsonl] [--json] [--plot FILE] [--top K]
[--section.key value ...]`: the planner's command line. fivefold.cli calls run_plan(argv).

Every bad input becomes one sentence on stderr and exit code 2; never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
from pathlib import Path

from fivefold.config import CheckpointConfig, Config, ConfigError, DataConfig
from fivefold.plan.compile_choice import planned_compile
from fivefold.plan.estimate import estimate
from fivefold.plan.goodput import goodput
from fivefold.plan.hardware import PROFILES, hardware_from_cluster
from fivefold.plan.speed.frameworks import FRAMEWORKS, runtime_for
from fivefold.plan.layout import Layout, layout_from_config, parse_layout, parse_layout_line
from fivefold.plan.report import plot_memory, table, to_json
from fivefold.plan.pipeline.short_chunks import NOTE as SHORT_CHUNKS_NOTE, planner_only, trainer_stand_in
from fivefold.config.file_errors import guarded, need_output_file
from fivefold.plan.search import (explain, explain_single, layout_problem, leanest_layout, main_reasons, search,
                                  smallest_fitting_cluster)
from fivefold.plan.workload import workload_from_config
from fivefold.configure import load_config, validate

USAGE = """usage: fivefold plan [CONFIG] [--cluster.gpus N] [--cluster.gpu h100] [--cluster.gpus_per_node 8]
                     [--layout "dp=8,zero=1,tp=2,pp=4,cp=1,ep=1,mbs=1,recompute=selective,pp_schedule=1f1b"]
                     [--layouts FILE.jsonl] [--json] [--plot FILE.png] [--top K] [--sweep K]
                     [--framework fivefold|torchtitan|megatron|megatron-2022|megatron-deepspeed|nanotron|fms-fsdp]
                     [--moe-rank-imbalance X|metrics.jsonl] [--optimizer-state-dtype fp32|bf16]
                     [--section.key value ...]

Without --layout, searches the layouts of --cluster.gpus GPUs and ranks them by predicted
tokens/s per GPU; with --layout (or --layouts, one JSON object per line) evaluates those.
--sweep K then trains the first K candidates for a few steps on local ranks (this machine) and
prints measured against predicted tokens/s and memory (use --cluster.gpu cpu on a laptop).
--framework predicts the time as that framework runs the layout (what it overlaps: docs/planner.md);
the default is fivefold's own (compiled when train.compile says so).
--moe-rank-imbalance X: the busiest expert-parallel rank's routed tokens over the mean, as a run
measured it: a number, or the run's metrics.jsonl (the median step's mean over its MoE layers);
the default is the least random routing gives.
--optimizer-state-dtype bf16: the run keeps its Adam moments and master weights in bf16 (NeMo's
optim.dtype = bf16), 2 bytes each; the default is fp32.
GPUs: """ + ", ".join(PROFILES)

VALUE_FLAGS = ("--layout", "--layouts", "--plot", "--top", "--sweep", "--framework", "--moe-rank-imbalance",
               "--optimizer-state-dtype")
OPTIMIZER_STATE_BYTES = {"fp32": 0.0, "bf16": 2.0}
GB = 1e9
GiB = 2 ** 30


class PlanError(Exception):
    """A bad input, explained in one sentence."""


class _Arguments(argparse.ArgumentParser):
    """The planner's own options; a mistake is one sentence, not a usage dump."""

    def error(self, message):
        missing = re.fullmatch(r"argument (--[\w-]+): expected one argument", message)
        if missing:
            flag = missing.group(1)
            raise PlanError(f"{flag} needs a value, e.g. {flag} {_example(flag)}")
        raise PlanError(f"fivefold plan: {message}; see `fivefold plan --help`")


def assumed(cfg) -> str:
    """What the plan prices, said in its header: precision, sequence, global batch, LoRA."""
    t = cfg.train
    lora = f"LoRA rank {cfg.lora.rank} on {cfg.lora.targets}" if cfg.lora.rank else "no LoRA"
    return f"{t.dtype}{' + fp8 ' + t.fp8 if t.fp8 else ''}, seq {t.seq_len}, global batch {t.global_batch}, {lora}"


def demo_defaults_note(cfg) -> str:
    """A model planned at the trainer's tiny-model defaults (fp32, sequence 128, 16 sequences): said,
    since a real run of it would not use them."""
    from fivefold.config.schema import TrainConfig

    defaults = TrainConfig()
    t = cfg.train
    if (t.dtype, t.seq_len, t.global_batch) != (defaults.dtype, defaults.seq_len, defaults.global_batch) \
            or cfg.model.max_seq_len <= defaults.seq_len:
        return ""
    return (f"\nnote: planned at the trainer's demo defaults (fp32, seq {defaults.seq_len}, global batch "
            f"{defaults.global_batch}); a real run of this model sets --train.dtype bf16, --train.seq_len (up to "
            f"its {cfg.model.max_seq_len}) and --train.global_batch")


def _parser() -> _Arguments:
    parser = _Arguments(prog="fivefold plan", add_help=False, allow_abbrev=False)
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("--json", action="store_true")
    for flag in VALUE_FLAGS:
        parser.add_argument(flag)  # a string here; each is checked where it is used, in one sentence
    return parser


def _parse_args(argv: list[str]) -> tuple[str | None, dict, list[str]]:
    """(CONFIG or None, the given planner options, the --section.key value overrides in order)."""
    own, rest = _parser().parse_known_args(argv)
    flags = {name: value for name, value in vars(own).items() if value is not None and value is not False}
    flags["json"] = own.json
    config, overrides = None, []
    i = 0
    while i < len(rest):
        arg = rest[i]
        name, _, inline = arg.partition("=")
        if arg.startswith("--"):
            if "." not in name:
                raise PlanError(f"unknown option {name}; see `fivefold plan --help`")
            if inline:
                overrides.append(arg)
            elif i + 1 < len(rest):
                overrides += [arg, rest[i + 1]]
                i += 1
            else:
                raise PlanError(f"{arg} needs a value, e.g. {arg} 8")
        elif config is None:
            config = arg
        else:
            raise PlanError(f"unexpected argument '{arg}'; give at most one CONFIG file")
        i += 1
    return config, flags, overrides


def _example(flag: str) -> str:
    return {"--layout": '"dp=8,tp=2"', "--layouts": "layouts.jsonl", "--plot": "memory.png",
            "--top": "5", "--sweep": "2", "--framework": "megatron", "--moe-rank-imbalance": "1.3"}[flag]


def _planning_config(cfg: Config) -> Config:
    """The planner needs no data or checkpoints: do not let their paths fail the plan."""
    return dataclasses.replace(cfg, data=DataConfig(), checkpoint=CheckpointConfig())


def _check_nodes(gpus: int, gpus_per_node: int, what: str) -> None:
    if gpus_per_node < 1:
        raise PlanError(f"cluster.gpus_per_node must be >= 1, got {gpus_per_node}")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise PlanError(f"{what} of {gpus} GPUs is not a whole number of {gpus_per_node}-GPU nodes; "
                        f"use a multiple of {gpus_per_node} or set --cluster.gpus_per_node")


def _count(flags: dict, name: str) -> int:
    try:
        value = int(flags[name])
    except ValueError:
        raise PlanError(f"--{name} must be a whole number, got '{flags[name]}'") from None
    if value < 1:
        raise PlanError(f"--{name} must be at least 1, got {value}")
    return value


def _top(flags: dict) -> int:
    try:
        top = int(flags.get("top", 10))
    except ValueError:
        raise PlanError(f"--top must be a whole number, got '{flags['top']}'") from None
    if top < 1:
        raise PlanError(f"--top must be at least 1, got {top}")
    return top


def _imbalance(flags: dict) -> float:
    """--moe-rank-imbalance: a measured max/mean load of the ep ranks, given as a number or as a
    run's metrics.jsonl (0 when not given)."""
    if "moe_rank_imbalance" not in flags:
        return 0.0
    text = flags["moe_rank_imbalance"]
    if Path(text).is_file():
        return measured_rank_imbalance(Path(text))
    if text.endswith((".jsonl", ".json")) or "/" in text:
        raise PlanError(f"--moe-rank-imbalance: {text} does not exist; give a run's metrics.jsonl or a number")
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 1.0 or value == float("inf"):
        raise PlanError(f"--moe-rank-imbalance must be a number >= 1 (the busiest expert-parallel rank's "
                        f"tokens over the mean, e.g. 1.3) or a run's metrics.jsonl, got '{text}'")
    return value


def measured_rank_imbalance(path: Path) -> float:
    """The median over a run's logged steps of the mean over its MoE layers of each layer's busiest
    ep rank's rows over the mean (`moe_layers[*].rank_imbalance` in metrics.jsonl): every layer waits
    for its own busiest rank, so the layers' mean is what a step pays, not the worst layer's."""
    per_step = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise PlanError(f"--moe-rank-imbalance: line {number} of {path} is not JSON; give the metrics.jsonl "
                            "a run wrote, or a number") from None
        layers = [layer["rank_imbalance"] for layer in (record.get("moe_layers") or {}).values()
                  if isinstance(layer, dict) and "rank_imbalance" in layer]
        if layers:
            per_step.append(sum(layers) / len(layers))
    if not per_step:
        raise PlanError(f"--moe-rank-imbalance: {path} logs no rank_imbalance; a run with parallel.ep > 1 writes "
                        "it in its metrics.jsonl")
    return max(1.0, statistics.median(per_step))


def _runtime(cfg, flags: dict):
    """The runtime profile: --framework NAME, else fivefold's (compiled when train.compile says so)."""
    name = flags.get("framework", "fivefold")
    if name != "fivefold" and name not in FRAMEWORKS:
        raise PlanError(f"--framework '{name}' is not one of {', '.join(FRAMEWORKS)}")
    runtime = runtime_for(planned_compile(cfg), name)
    state = flags.get("optimizer_state_dtype")
    if state is None:
        return runtime
    if state not in OPTIMIZER_STATE_BYTES:
        raise PlanError(f"--optimizer-state-dtype '{state}' is not one of {', '.join(OPTIMIZER_STATE_BYTES)}")
    return dataclasses.replace(runtime, optimizer_state_bytes=OPTIMIZER_STATE_BYTES[state])


def _evaluate_given(cfg, workload, hw, layouts: list[Layout], where: list[str], runtime):
    gpus = cfg.cluster.gpus
    out = []
    for layout, label in zip(layouts, where):
        layout = layout.resolved(workload.global_batch)
        world = layout.world_size
        if gpus and world != gpus:
            raise PlanError(f"{label}: dp*tp*pp*cp = {layout.dp}*{layout.tp}*{layout.pp}*"
                            f"{layout.cp} = {world} but --cluster.gpus is {gpus}; make them equal")
        _check_nodes(world, hw.gpus_per_node, f"{label}: a layout")
        short = planner_only(layout, workload.stats.n_layers)
        checked = trainer_stand_in(layout, workload.stats.n_layers) if short else layout
        problem = layout_problem(cfg, workload, checked, world)
        if problem:
            raise PlanError(f"{label}: {problem}")
        est = estimate(workload, layout, hw, runtime)
        explain_single(est)
        if short:
            est.why = f"{est.why}; {SHORT_CHUNKS_NOTE}"
        out.append(est)
    return out


def _plan(argv: list[str]) -> int:
    config, flags, overrides = _parse_args(argv)
    if flags.get("help"):
        print(USAGE)
        return 0
    if "layout" in flags and "layouts" in flags:
        raise PlanError("give either --layout or --layouts, not both")
    top = _top(flags)
    sweep = _count(flags, "sweep") if "sweep" in flags else 0
    train_cfg = load_config(config, overrides)
    cfg = _planning_config(train_cfg)
    validate(cfg)
    try:
        hw = hardware_from_cluster(cfg.cluster)
    except ValueError as err:
        raise PlanError(str(err)) from None
    except KeyError:
        raise PlanError(f"cluster.gpu='{cfg.cluster.gpu}' is not one of {', '.join(PROFILES)}") from None
    workload = dataclasses.replace(workload_from_config(cfg), moe_rank_imbalance=_imbalance(flags))
    runtime = _runtime(cfg, flags)
    if flags.get("plot"):
        try:
            import matplotlib  # noqa: F401  (checked before any work)
        except ImportError:
            raise PlanError("--plot needs matplotlib; install it with `pip install matplotlib`") from None
        need_output_file(flags["plot"], "--plot", "give the path of a .png file to write")

    rejected = n_fitting = n_rejected = None
    base = layout_from_config(cfg)
    name = cfg.model.preset
    if "layout" in flags:
        layouts = [parse_layout(flags["layout"], base)]
        candidates = _evaluate_given(cfg, workload, hw, layouts, ["--layout"], runtime)
        title = f"{name} on {layouts[0].world_size} x {hw.name}: the given layout"
    elif "layouts" in flags:
        path = Path(flags["layouts"])
        if not path.is_file():
            raise PlanError(f"--layouts file {path} does not exist; give a JSONL file, one layout per line")
        lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
        if not lines:
            raise PlanError(f"--layouts file {path} has no layouts; write one JSON object per line")
        layouts = [parse_layout_line(line, n, base) for n, line in lines]
        candidates = _evaluate_given(cfg, workload, hw, layouts,
                                     [f"line {n} of --layouts" for n, _ in lines], runtime)
        title = f"{name} on {hw.name}: {len(candidates)} given layouts, in file order"
    else:
        gpus = cfg.cluster.gpus
        if gpus < 1:
            raise PlanError("give the cluster size with --cluster.gpus N (or a --layout to evaluate)")
        _check_nodes(gpus, hw.gpus_per_node, "a cluster")
        result = search(cfg, workload, hw, runtime, gpus)
        ranked = []  # the winners, re-checked with the training code's full rules
        for est in result.ranked:
            if len(ranked) == top:
                break
            if not layout_problem(cfg, workload, est.layout, gpus):
                ranked.append(est)
        if not ranked:
            raise PlanError(_fits_nowhere(cfg, workload, hw, gpus, result, runtime))
        explain(ranked)  # the comparisons name the runner-up that survived the re-check
        candidates, rejected = ranked, result.rejected
        n_fitting, n_rejected = len(result.ranked), result.n_rejected
        title = (f"{name} on {gpus} x {hw.name} ({hw.memory_bytes / GiB:.1f} GiB = {hw.memory_bytes / GB:.1f} GB), "
                 f"{assumed(cfg)}: best layouts by predicted tokens/s per GPU" + demo_defaults_note(cfg))

    for est in candidates:  # goodput and cost of train.steps steps (plan/goodput.py)
        est.goodput = goodput(workload, est.layout, hw, est.step_time_s, cfg.train.steps, cfg.cluster)
    if flags["json"]:
        print(to_json(candidates, rejected))
    else:
        print(table(candidates, title, rejected, n_fitting, n_rejected))
    if flags.get("plot"):
        with guarded(flags["plot"], "write", "or give --plot another path"):
            plot_memory(candidates, flags["plot"], hw.memory_bytes, title)
        if not flags["json"]:
            print(f"memory plot written to {flags['plot']}")
    if sweep:
        from fivefold.plan.sweep import sweep_table

        print(f"\nmeasured on this machine ({sweep} layouts, a few steps each):", file=sys.stderr)
        print(sweep_table(train_cfg, [c for c in candidates if c.fits][:sweep]),
              file=sys.stderr if flags["json"] else sys.stdout)
    return 0


def _fits_nowhere(cfg, workload, hw, gpus: int, result, runtime) -> str:
    name = cfg.model.preset
    lean = leanest_layout(cfg, workload, hw, runtime, gpus)
    if lean is None:
        reason = (main_reasons(result.rejected, result.n_rejected) if result.rejected
                  else "no degrees divide the cluster")
        return (f"no valid layout of {name} exists on {gpus} GPUs ({reason}); "
                f"change --cluster.gpus or train.global_batch")
    need = f"; even the leanest layout ({lean[0].short()}) needs {lean[1] / GiB:.1f} GiB per GPU"
    found = smallest_fitting_cluster(cfg, workload, hw, runtime, 2 * gpus)
    if found is None:
        return f"{name} fits on no cluster of {hw.name} GPUs{need}; use GPUs with more memory"
    n, layout = found
    return (f"{name} does not fit on {gpus} {hw.name} GPUs of {hw.memory_bytes / GiB:.1f} GiB{need}; "
            f"the smallest GPU count on which it fits is {n}, e.g. --cluster.gpus {n} --layout "
            f"\"dp={layout.dp},tp={layout.tp},pp={layout.pp},cp={layout.cp},ep={layout.ep},"
            f"zero={layout.zero},mbs=1,recompute=full\"")


def run_plan(argv: list[str]) -> int:
    """Entry point used by `fivefold plan`: returns the exit code."""
    try:
        return _plan(list(argv))
    except (ConfigError, PlanError) as err:
        print(f"fivefold plan: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(run_plan(sys.argv[1:]))
