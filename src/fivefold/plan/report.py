"""What `fivefold plan` prints: a readable table, the JSON of the contract (docs/design.md, Planner),
and a stacked-bar plot of the memory of the top layouts."""

from __future__ import annotations

import json
from collections import Counter

from fivefold.plan.estimate import Estimate
from fivefold.plan.search import Rejected, reason_kind

GB = 1e9
GiB = 2 ** 30  # memory in GiB (nvidia-smi's and torch.cuda's unit); communication in GB
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "other")


def to_json(candidates: list[Estimate], rejected: list[Rejected] | None = None) -> str:
    """{"candidates": [...]} per the contract; "rejected" (layout + reason) only for searches."""
    out: dict = {"candidates": [c.to_json() for c in candidates]}
    if rejected:
        out["rejected"] = [{"layout": r.layout.to_dict(), "reason": r.reason} for r in rejected]
    return json.dumps(out, indent=2)


def _row(i: int, est: Estimate) -> list[str]:
    mem = est.memory
    return [str(i), est.layout.short(), "yes" if est.fits else "NO",
            f"{mem.total / GiB:.1f}", f"{est.tokens_per_sec_per_gpu:,.0f}", _band(est), f"{est.mfu:.1%}",
            _seconds(est.step_time_s), f"{est.bubble_fraction:.0%}"]


def _goodput_lines(candidates: list[Estimate]) -> list[str]:
    """Goodput and the cost of train.steps steps (plan/goodput.py), where the command attached them."""
    shown = [(i, est.goodput) for i, est in enumerate(candidates) if est.goodput]
    if not shown:
        return []
    lines = ["", "goodput with failures (checkpoint interval that maximises it) and train.steps' cost:"]
    for i, g in shown:
        lines.append(f"{i + 1}. goodput {g.goodput:.1%} (checkpoint every {g.checkpoint_interval_s:,.0f} s of "
                     f"training, {g.checkpoint_s:.1f} s each); {g.train_days:,.1f} days, ${g.usd:,.0f}, "
                     f"{g.kwh:,.0f} kWh")
    return lines


def _band(est: Estimate) -> str:
    """The calibration's error beside the prediction: half the published runs fell within the
    first, nine in ten within the second (benchmarks/RESULTS.md, planner accuracy)."""
    med, p90 = est.error
    return f"±{med:.0%}/{p90:.0%}"


def _seconds(value: float) -> str:
    return f"{value:.3g}" if value < 1000 else f"{value:,.0f}"


def _format(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) if j not in (1,) else c.ljust(w) for j, (c, w) in
                        enumerate(zip(r, widths))) for r in rows]
    return lines


def table(candidates: list[Estimate], title: str, rejected: list[Rejected] | None = None,
          n_fitting: int | None = None, n_rejected: int | None = None) -> str:
    header = ["#", "layout", "fits", "mem GiB", "tok/s/GPU", "± p50/p90", "MFU", "step s", "bubble"]
    lines = [title, ""]
    lines += _format([_row(i + 1, e) for i, e in enumerate(candidates)], header)
    lines.append("")
    for i, est in enumerate(candidates):
        lines.append(f"{i + 1}. {est.why}")
    if candidates:
        lines += ["", "memory of the worst rank (GiB = 2^30 bytes): "
                  + ", ".join(MEMORY_PARTS) + "; communication per step per rank (GB = 1e9 bytes): "
                  "dp, tp, pp, cp, ep"]
        for i, est in enumerate(candidates):
            m = est.memory
            mem = " ".join(f"{getattr(m, k) / GiB:.1f}" for k in MEMORY_PARTS)
            com = " ".join(f"{est.comm_bytes[k] / GB:.2g}" for k in ("dp", "tp", "pp", "cp", "ep"))
            lines.append(f"{i + 1}. memory {mem} | comm {com}")
    lines += _muon_lines(candidates)
    lines += _goodput_lines(candidates)
    if candidates:
        lines += ["", f"time profile: {candidates[0].profile} (overlaps {candidates[0].overlaps})"]
        lines += ["± p50/p90: the time model's tokens/s error on published runs (half within the "
                  "first, nine in ten within the second; benchmarks/RESULTS.md)"]
    if n_fitting is not None:
        lines += ["", f"{n_fitting} layouts fit; showing the top {len(candidates)}."]
    if rejected:
        reasons = Counter(reason_kind(r.reason) for r in rejected)
        total = n_rejected if n_rejected is not None else len(rejected)
        lines.append(f"{total} layouts rejected; by kind, among the first {len(rejected)}:")
        seen: set[str] = set()
        for r in rejected:
            kind = reason_kind(r.reason)
            if kind in seen:
                continue
            seen.add(kind)
            lines.append(f"  {reasons[kind]} x  e.g. {r.layout.short()}: {r.reason}")
    return "\n".join(lines)


def _muon_lines(candidates: list[Estimate]) -> list[str]:
    """Under train.optimizer = muon: where each layout's Newton–Schulz runs and what it costs, as
    the trainer's log says it (the heaviest pipeline stage)."""
    shown = [(i, e.muon) for i, e in enumerate(candidates) if e.muon]
    if not shown:
        return []
    lines = ["", "muon (the slowest stage): where matrices are orthogonalised; seconds of Newton–Schulz + "
             "gathers per step; GFLOP per rank of each group, largest / mean"]
    for i, muon in shown:
        spread = ", ".join(f"{name} {max(g):.3g} / {sum(g) / len(g):.3g}"
                           for name, g in muon["gflop_by_rank"].items() if g)
        lines.append(f"{i + 1}. {muon['where']}; {_seconds(muon['newton_schulz_s'])} + "
                     f"{_seconds(muon['gather_s'])} s; {spread}")
    return lines


def plot_memory(candidates: list[Estimate], path: str, memory_limit: float, title: str) -> None:
    """Stacked bars (params, grads, optimizer, activations, other) per layout against the GPU's
    memory. matplotlib is imported here so that planning never pays for it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{i + 1}. {c.layout.short()}" for i, c in enumerate(candidates)]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(candidates) + 2), 5))
    bottom = [0.0] * len(candidates)
    for part in MEMORY_PARTS:
        values = [getattr(c.memory, part) / GiB for c in candidates]
        ax.bar(range(len(candidates)), values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(memory_limit / GiB, color="black", linestyle="--", label="GPU memory")
    ax.set_xticks(range(len(candidates)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("GiB per GPU (worst rank)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
