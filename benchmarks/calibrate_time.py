"""Fit the torch stacks' time constants on a declared set of published runs, report the error on
the runs each fit leaves out, and write the constants with their provenance into plan/fitted.py.

    PYTHONPATH=src .venv/bin/python benchmarks/calibrate_time.py [--dry-run]   # ~30 min, 1 core

What it fits (PARAMS; each a physical quantity, none per model, layout or row): H100's large-GEMM
efficiency in a training step, the inter-node ring-step latency and the tapered fabric's falloff
(shared hardware terms); nanotron's host times, its pipeline-wait and slot-stall terms, its
gradient all-reduce's share of the link, and its elementwise passes (the nanotron profile); the
fivefold eager and compiled profiles' elementwise passes; torchao's FP8 GEMM speed-up.

The split (committed here): the fit set is every Playbook run that ran (playbook_runs_dev.csv,
nanotron) and the even rows of torchtitan's (torchtitan_h100_2024.csv, PyTorch-native, the stack
fivefold is built from); the odd torchtitan rows are held out. The fit is coordinate descent on a
multiplicative grid (STEPS) from the committed values, minimising the median relative tokens/s
error over the Playbook runs plus that over its 32-64-node runs plus that over the fitted
torchtitan rows, plus the shortfall of the Playbook's median within-group Spearman rho below 0.86.

Out of sample: leave-one-model-out. For each of the six models (the Playbook's 1B, 3B, 8B;
torchtitan's Llama 3.1 8B, 70B, 405B) the same fit without that model's rows predicts all of
them. (Leaving a whole source out is not possible: the nanotron terms are seen only in the
Playbook and the fivefold profiles' only in torchtitan.) The bands `plan` prints for the nanotron
and fivefold profiles (Runtime.tokens_per_sec_error) are the median and 90th percentile of those
left-out errors. Each fold starts where the full fit does, from the committed values.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import planner_accuracy as acc  # noqa: E402
from fivefold.plan import fitted  # noqa: E402
from fivefold.plan.hardware import hardware_for
from fivefold.plan.speed.frameworks import FIVEFOLD_COMPILED, FIVEFOLD_EAGER, NANOTRON_RUNTIME  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FITTED = REPO / "src" / "fivefold" / "plan" / "fitted.py"
# (owner, field) -> the plan/fitted.py name written. Owner: "hw" (shared hardware), "nano" (the
# nanotron profile), "eager" / "compiled" (fivefold's profiles), "fp8" (their FP8 speed-up).
PARAMS = {("hw", "matmul_efficiency"): "H100_MATMUL_EFFICIENCY",
          ("hw", "inter_latency_s"): "INTER_NODE_LATENCY_S",
          ("hw", "fabric_nodes"): "TAPERED_FABRIC_NODES",
          ("nano", "launch_s"): "NANOTRON_LAUNCH_S",
          ("nano", "collective_host_s"): "NANOTRON_COLLECTIVE_HOST_S",
          ("nano", "pp_cross_node_wait_per_tp_peer_s"): "NANOTRON_PP_WAIT_PER_TP_PEER_S",
          ("nano", "slot_stall_s"): "NANOTRON_SLOT_STALL_S",
          ("nano", "dp_bw_efficiency"): "NANOTRON_DP_BW_EFFICIENCY",
          ("nano", "elementwise_passes"): "NANOTRON_ELEMENTWISE_PASSES",
          ("eager", "elementwise_passes"): "EAGER_ELEMENTWISE_PASSES",
          ("compiled", "elementwise_passes"): "COMPILED_ELEMENTWISE_PASSES",
          ("fp8", "speedup"): "FLOAT8_LINEAR_SPEEDUP"}
STEPS = (0.6, 0.8, 0.9, 1.0, 1.1, 1.25, 1.6)
SWEEPS = 3
PLAYBOOK_MODELS = tuple(acc.SHAPES)
TITAN_MODELS = tuple(acc.TITAN_SHAPES)


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _errors(pred: list[dict]) -> list[float]:
    return [abs(r["pred_tok_s"] / float(r["tok_s_gpu"]) - 1) for r in pred]


def quantile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def committed_values() -> dict:
    """The constants as plan/fitted.py holds them now (the fit's start)."""
    return {key: getattr(fitted, name) for key, name in PARAMS.items()}


class Problem:
    """The split's rows, and the planner's predictions of them under a set of constants."""

    def __init__(self):
        self.playbook = [r for r in _rows(acc.DEFAULT_CSV) if r["status"] == "ok"]
        titan = _rows(acc.TORCHTITAN_CSV)
        self.titan_fit, self.titan_held = titan[0::2], titan[1::2]

    def models(self, values: dict):
        pick = lambda owner: {f: v for (o, f), v in values.items() if o == owner}  # noqa: E731
        hw = dataclasses.replace(acc.playbook_hardware(), **pick("hw"))
        nano = dataclasses.replace(NANOTRON_RUNTIME, **pick("nano"))
        eager = dataclasses.replace(FIVEFOLD_EAGER, **pick("eager"))
        compiled = dataclasses.replace(FIVEFOLD_COMPILED, **pick("compiled"))
        titan_hw = dataclasses.replace(hw, fabric="full_bisection", memory_bytes=96 * 2 ** 30,
                                       matmul_efficiency=hw.matmul_efficiency * acc.POWER_DERATE)
        return hw, nano, eager, compiled, titan_hw

    def predict(self, values: dict, playbook: list[dict], titan: list[dict]) -> tuple[list[dict], list[dict]]:
        hw, nano, eager, compiled, titan_hw = self.models(values)
        acc.FLOAT8_LINEAR_SPEEDUP = values[("fp8", "speedup")]
        pb = acc.predict(playbook, runtime=nano, hw=hw) if playbook else []
        tt = acc.titan_predict(titan, eager, compiled, titan_hw) if titan else []
        return pb, tt

    def objective(self, values: dict, playbook: list[dict], titan: list[dict]) -> float:
        pb, tt = self.predict(values, playbook, titan)
        pb_err = _errors(pb)
        big = [e for e, r in zip(pb_err, pb) if int(r["nodes"]) >= 32]
        rho = acc.summarize([{**r, "pred_fits": r.get("pred_fits", True)} for r in pb])["spearman_median"]
        # Ranking matters as much as the error: below 0.86 each 0.01 of Spearman costs 1% of error.
        return (statistics.median(pb_err) + statistics.median(big) + statistics.median(_errors(tt))
                + max(0.0, 0.86 - rho))

    def fit(self, playbook: list[dict], titan: list[dict], label: str) -> dict:
        values = committed_values()
        best = self.objective(values, playbook, titan)
        for sweep in range(SWEEPS):
            moved = False
            for key in PARAMS:
                start = values[key]
                for step in STEPS:
                    trial = {**values, key: start * step}
                    score = self.objective(trial, playbook, titan)
                    if score < best - 1e-6:
                        best, values, moved = score, trial, True
            print(f"  {label}: sweep {sweep + 1}, objective {best:.4f}", flush=True)
            if not moved:  # a sweep that moved nothing would repeat itself
                break
        return values


def _without(rows: list[dict], model: str) -> list[dict]:
    return [r for r in rows if r["model"] != model]


def leave_one_model_out(problem: Problem) -> dict:
    """model -> (its constants fitted without it, |error| of each of its rows under them)."""
    out = {}
    for model in PLAYBOOK_MODELS + TITAN_MODELS:
        values = problem.fit(_without(problem.playbook, model), _without(problem.titan_fit, model),
                             f"without {model}")
        own_pb = [r for r in problem.playbook if r["model"] == model]
        own_tt = [r for r in problem.titan_fit + problem.titan_held if r["model"] == model]
        pb, tt = problem.predict(values, own_pb, own_tt)
        out[model] = (values, _errors(pb) + _errors(tt))
    return out


def _block(values: dict, bands: dict, lomo: dict, held: float, fit_err: dict) -> str:
    """plan/fitted.py's calibrate_time.py block: the constants, the bands, and their provenance."""
    names = {name: values[key] for key, name in PARAMS.items()}
    lines = [f"{name} = {value!r}" for name, value in names.items()]
    lines.append(f"NANOTRON_BAND = ({bands['nanotron'][0]:.3f}, {bands['nanotron'][1]:.3f})")
    lines.append(f"FIVEFOLD_BAND = ({bands['fivefold'][0]:.3f}, {bands['fivefold'][1]:.3f})")
    folds = {model: {PARAMS[key]: v for key, v in fold.items()} for model, (fold, _) in lomo.items()}
    lines.append(f"TIME_LEAVE_ONE_MODEL_OUT = {folds!r}")
    fit_set = ("benchmarks/calibrate_time.py: fitted on the Playbook's 1,620 runs that ran "
               "(playbook_runs_dev.csv) and torchtitan_h100_2024.csv's even rows; in sample: Playbook "
               f"median {fit_err['playbook']:.3f}, torchtitan even rows {fit_err['titan']:.3f}; "
               f"odd rows held out: median {held:.3f}")
    sets = {name: fit_set for name in names}
    sets["NANOTRON_BAND"] = ("leave-one-model-out over the Playbook's 1B, 3B and 8B runs (each predicted by "
                             f"the constants fitted without its model): median {bands['nanotron'][0]:.3f}, "
                             f"p90 {bands['nanotron'][1]:.3f}")
    sets["FIVEFOLD_BAND"] = ("leave-one-model-out over torchtitan's 18 rows (Llama 3.1 8B, 70B, 405B): median "
                             f"{bands['fivefold'][0]:.3f}, p90 {bands['fivefold'][1]:.3f}")
    sets["TIME_LEAVE_ONE_MODEL_OUT"] = "benchmarks/calibrate_time.py: each fold's constants (the fit without that model)"
    text = "\n".join(lines) + "\nTIME_FIT_SETS = {\n"
    text += "".join(f"    {k!r}: {v!r},\n" for k, v in sets.items())
    return text + "}\n"


def write(block: str) -> None:
    src = FITTED.read_text()
    begin, end = "# --- written by benchmarks/calibrate_time.py\n", "# --- end of benchmarks/calibrate_time.py\n"
    start, stop = src.index(begin) + len(begin), src.index(end)
    FITTED.write_text(src[:start] + block + src[stop:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print, do not write plan/fitted.py")
    args = ap.parse_args(argv)
    for path in (acc.DEFAULT_CSV, acc.TORCHTITAN_CSV):
        if not path.is_file():
            print(f"{path} is not there (the published runs live in ../shared/data)", file=sys.stderr)
            return 2
    problem = Problem()
    values = problem.fit(problem.playbook, problem.titan_fit, "all of the fit set")
    pb, tt = problem.predict(values, problem.playbook, problem.titan_fit)
    held = statistics.median(_errors(problem.predict(values, [], problem.titan_held)[1]))
    fit_err = {"playbook": statistics.median(_errors(pb)), "titan": statistics.median(_errors(tt))}
    print("constants (committed -> fitted):")
    start = committed_values()
    for key, name in PARAMS.items():
        print(f"  {name:32s} {start[key]!r:>24} -> {values[key]!r}")
    print(f"in sample: Playbook median {fit_err['playbook']:.1%}, torchtitan even rows {fit_err['titan']:.1%}; "
          f"torchtitan odd rows (held out) {held:.1%}")
    lomo = leave_one_model_out(problem)
    print("\nleave-one-model-out: each model's rows predicted by the constants fitted without it")
    print(f"{'model':16s} {'rows':>5s} {'median':>8s} {'p90':>8s}")
    for model, (_, errs) in lomo.items():
        print(f"{model:16s} {len(errs):5d} {statistics.median(errs):8.1%} {quantile(errs, 0.9):8.1%}")
    nano = [e for m in PLAYBOOK_MODELS for e in lomo[m][1]]
    five = [e for m in TITAN_MODELS for e in lomo[m][1]]
    bands = {"nanotron": (statistics.median(nano), quantile(nano, 0.9)),
             "fivefold": (statistics.median(five), quantile(five, 0.9))}
    print(f"Playbook (nanotron profile): median {bands['nanotron'][0]:.1%}, p90 {bands['nanotron'][1]:.1%}")
    print(f"torchtitan (fivefold profiles): median {bands['fivefold'][0]:.1%}, p90 {bands['fivefold'][1]:.1%}")
    if args.dry_run:
        return 0
    write(_block(values, bands, lomo, held, fit_err))
    print(f"wrote {FITTED.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
