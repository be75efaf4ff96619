"""The planner against our own runs: activation bytes and communication per rank, measured in
training on local CPU ranks beside what `fivefold plan` predicts for the same layout.

    OMP_NUM_THREADS=1 python benchmarks/planner_vs_runs.py      # ~2 minutes on 2 CPU cores

The layouts and the measuring code are the tests' (tests/test_plan_activations.py,
tests/test_plan_comm.py, which assert 10% and 1%); this prints the numbers behind them.
Activations: bytes one micro-batch's forward keeps for backward (train/activation_probe.py), the
worst rank. Communication: the ledger's bytes per rank in the last of 2 steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_plan_activations as activations  # noqa: E402
import test_plan_comm as comm  # noqa: E402
from ranks import run_on_ranks  # noqa: E402


def activation_table() -> None:
    measured = activations._measure(activations.ONE_RANK)
    per_rank = run_on_ranks(2, activations._measure, activations.TWO_RANKS)
    measured.update({k: max(r[k] for r in per_rank) for k in activations.TWO_RANKS})
    layouts = {**activations.ONE_RANK, **activations.TWO_RANKS}
    print("| layout | measured bytes | predicted | predicted / measured |")
    print("|---|---|---|---|")
    for label, got in measured.items():
        want = activations._predicted(layouts[label])
        print(f"| {label} | {got:,} | {want:,.0f} | {want / got:.3f} |", flush=True)


def comm_table() -> None:
    two = run_on_ranks(2, comm._ledgers, comm.TWO_RANKS)
    four = run_on_ranks(4, comm._ledgers, comm.FOUR_RANKS)
    print("\n| layout | dimension | ledger bytes/rank/step | planned | planned / ledger |")
    print("|---|---|---|---|---|")
    for ranks, layouts in ((two, comm.TWO_RANKS), (four, comm.FOUR_RANKS)):
        for label, overrides in layouts.items():
            predicted = comm._predicted(overrides)
            for dim in comm._dimensions(overrides):
                per_rank = [r[label].get(dim, 0) for r in ranks]
                got = sum(per_rank) / len(per_rank) if dim == "ep" else max(per_rank)
                want = predicted[dim]
                note = ""
                if dim == "cp" and "dp" not in ranks[0][label]:
                    want += predicted["dp"]
                    note = " (+dp: same group)"
                print(f"| {label} | {dim}{note} | {got:,.0f} | {want:,.0f} | {want / got:.3f} |", flush=True)


if __name__ == "__main__":
    activation_table()
    comm_table()
