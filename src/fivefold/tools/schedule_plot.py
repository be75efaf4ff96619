"""The picture of one pipeline step: a row per rank, a block per action, coloured by micro-batch.

Drawn from the action table of the schedule classes that train (parallel/pipeline/schedule_table.py), so
the picture is of the code that runs: forward blocks solid, backward blocks hatched (input- and
weight-gradient halves of zero-bubble schedules lighter), white gaps are the bubble.
"""

from __future__ import annotations

from fivefold.parallel.pipeline.schedule_table import action_table, bubble_fraction, timeline

_HATCH = {"F": "", "B": "//", "I": "//", "W": ".."}
_ALPHA = {"F": 1.0, "B": 0.8, "I": 0.8, "W": 0.45}


def draw_schedule(schedule: str, pp: int, virtual: int, n_micro: int, path: str) -> float:
    """Write the picture to `path`; returns the bubble fraction it shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    blocks = timeline(action_table(schedule, pp, virtual, n_micro), pp * virtual)
    bubble = bubble_fraction(blocks)
    colours = plt.get_cmap("tab20" if n_micro > 10 else "tab10")
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * max(b.end for b in blocks)), 0.7 * pp + 1.6))
    for block in blocks:
        width = (block.end - block.start) / len(block.actions)
        for i, action in enumerate(block.actions):
            x = block.start + i * width
            ax.barh(block.rank, width, left=x, height=0.8, color=colours(action.micro_batch % colours.N),
                    alpha=_ALPHA[action.kind], hatch=_HATCH[action.kind], edgecolor="black", linewidth=0.5)
            label = f"{action.kind}{action.micro_batch}" + (f"\ns{action.stage}" if virtual > 1 else "")
            ax.text(x + width / 2, block.rank, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time (forward = 1, backward = 2, input/weight gradient = 1 each)")
    ax.set_title(f"{schedule}: pp={pp}, {virtual} stage(s) per rank, {n_micro} micro-batches — "
                 f"bubble {100 * bubble:.1f}%")
    ax.legend(handles=[Patch(facecolor="grey", label="F forward"),
                       Patch(facecolor="grey", hatch="//", alpha=0.8, label="B / I backward"),
                       Patch(facecolor="grey", hatch="..", alpha=0.45, label="W weight gradient")],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return bubble
