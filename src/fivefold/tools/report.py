"""`fivefold report RUN_DIR`: a run's metrics.jsonl drawn as pictures, in RUN_DIR/report/.

  loss.png        training loss by step, and the held-out loss where it was measured
  speed.png       tokens per second, and MFU where the device's peak is known (GPUs, cluster.peak_tflops)
  memory.png      each rank's peak memory by step (the log.every steps, when all ranks report it)
  pipeline.png    the measured pipeline bubble (runs with parallel.pp > 1)
  moe_load.png    the share of tokens each expert of each MoE layer received over the run (a heatmap)

A picture whose figures the run did not record is not drawn. A run resumed after a stop logs its
steps again from the checkpoint on: the last record of each step is the one drawn.
"""

from __future__ import annotations

import json
from pathlib import Path

from fivefold.config import ConfigError
from fivefold.config.file_errors import guarded, need_folder, need_output_folder


def read_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no metrics.jsonl; give the log.dir of a run")
    by_step = {}
    with guarded(path, "read"):
        text = path.read_text()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ConfigError(f"{path}:{number} is not a JSON line; the file is damaged") from None
        by_step[record["step"]] = record  # a resumed run's repeat of a step replaces the first
    if not by_step:
        raise ConfigError(f"{path} has no steps yet")
    return [by_step[s] for s in sorted(by_step)]


def _series(records, key):
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def _loss(ax_row, records):
    (ax,) = ax_row
    ax.plot(*_series(records, "loss"), label="training loss")
    steps, val = _series(records, "val_loss")
    if val:
        ax.plot(steps, val, "o-", label="held-out loss")
    ax.set(title="loss" + (" and held-out loss" if val else ""), xlabel="step", ylabel="cross-entropy")
    ax.legend()
    return [ax.get_title()]


def _speed(ax_row, records):
    ax, mfu_ax = ax_row
    ax.plot(*_series(records, "tokens_per_sec"))
    ax.set(title="tokens per second (all ranks)", xlabel="step", ylabel="tokens/s")
    steps, mfu = _series(records, "mfu")
    if mfu:
        mfu_ax.plot(steps, [100 * m for m in mfu])
        mfu_ax.set(title="MFU", xlabel="step", ylabel="% of peak")
    else:
        mfu_ax.set(title="MFU")
        mfu_ax.text(0.5, 0.5, "no peak FLOP/s for this device\n(set cluster.peak_tflops)", ha="center",
                    va="center", transform=mfu_ax.transAxes)
    return [ax.get_title(), mfu_ax.get_title()]


def _memory(ax_row, records):
    (ax,) = ax_row
    ranks = max(len(r["peak_mem_bytes_per_rank"]) for r in records if "peak_mem_bytes_per_rank" in r)
    for rank in range(ranks):
        points = [(r["step"], r["peak_mem_bytes_per_rank"][rank] / 2**20) for r in records
                  if len(r.get("peak_mem_bytes_per_rank", [])) > rank]
        ax.plot([s for s, _ in points], [m for _, m in points], ".-", label=f"rank {rank}")
    ax.set(title="peak memory per rank", xlabel="step", ylabel="MiB (CUDA: allocated; CPU: resident)")
    ax.legend(fontsize="small", ncol=max(1, ranks // 8))
    return [ax.get_title()]


def _pipeline(ax_row, records):
    (ax,) = ax_row
    steps, bubble = _series(records, "bubble_fraction")
    ax.plot(steps, [100 * b for b in bubble])
    ax.set(title="pipeline bubble (idle share of the pipeline ranks)", xlabel="step", ylabel="%")
    return [ax.get_title()]


def _moe_load(ax_row, records):
    (ax,) = ax_row
    layers = sorted({layer for r in records for layer in r.get("moe_layers", {})}, key=int)
    rows = []
    for layer in layers:
        counts = [r["moe_layers"][layer]["tokens_per_expert"] for r in records if layer in r.get("moe_layers", {})]
        totals = [sum(col) for col in zip(*counts)]
        rows.append([t / max(1, sum(totals)) for t in totals])
    image = ax.imshow(rows, aspect="auto", cmap="viridis")
    ax.set(title="MoE load: share of each layer's tokens per expert", xlabel="expert", ylabel="MoE layer",
           xticks=range(len(rows[0])), yticks=range(len(layers)), yticklabels=layers)
    ax.figure.colorbar(image, ax=ax, label="share of tokens")
    return [ax.get_title()]


# file -> (panels per row, whether the run has the figures, drawing)
PICTURES = {
    "loss.png": (1, lambda rs: any("loss" in r for r in rs), _loss),
    "speed.png": (2, lambda rs: any("tokens_per_sec" in r for r in rs), _speed),
    "memory.png": (1, lambda rs: any("peak_mem_bytes_per_rank" in r for r in rs), _memory),
    "pipeline.png": (1, lambda rs: any("bubble_fraction" in r for r in rs), _pipeline),
    "moe_load.png": (1, lambda rs: any(r.get("moe_layers") for r in rs), _moe_load),
}


def draw_report(run_dir) -> dict[str, list[str]]:
    """Write the pictures the run's records allow; returns file -> the titles of its panels."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("fivefold report draws with matplotlib: pip install 'fivefold[plot]'") from None
    run_dir = need_folder(run_dir, "report RUN_DIR", "give the log.dir of a run")
    records = read_records(run_dir)
    out = need_output_folder(run_dir / "report", "report folder", "move it away: fivefold report draws there")
    with guarded(out, "write", "or free space and run fivefold report again"):
        return _draw(plt, run_dir, out, records)


def _draw(plt, run_dir: Path, out: Path, records: list[dict]) -> dict[str, list[str]]:
    out.mkdir(exist_ok=True)
    drawn = {}
    for name, (columns, present, draw) in PICTURES.items():
        if not present(records):
            continue
        fig, axes = plt.subplots(1, columns, figsize=(6 * columns, 4), squeeze=False)
        drawn[name] = draw(list(axes[0]), records)
        fig.suptitle(run_dir.name)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
    return drawn
