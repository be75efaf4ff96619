"""The action table of a pipeline schedule, and its timeline with given costs.

The table comes from the very schedule classes that train (`torch.distributed.pipelining`): they
compute every rank's list of actions from the stage layout alone, so stand-in stages with just
that layout are enough — no process group, no model. The timeline then replays those lists with a
cost per action kind, each action starting when its rank is free and its inputs exist (the
previous stage's forward, the next stage's backward). Idle time is the bubble.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fivefold.parallel.pipeline.stages import SCHEDULES
from fivefold.config.schedules import SINGLE_STAGE_SCHEDULES
from fivefold.plan.pipeline.stage_split import stages_of_rank

# Relative costs: a backward is twice a forward; split into input- and weight-gradient halves.
DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


class _StageLayout:
    """What a schedule reads from a stage to plan its actions, and nothing else."""

    def __init__(self, stage_index: int, num_stages: int, group_rank: int, group_size: int):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_rank, self.group_size = group_rank, group_size
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod = nn.Module()
        self.has_backward = True
        self.stage_index_to_group_rank: dict[int, int] = {}


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str  # F forward, B full backward, I input-gradient, W weight-gradient
    micro_batch: int


def action_table(schedule: str, pp: int, virtual: int, n_micro: int) -> dict[int, list[list[Action]]]:
    """rank -> its actions in order; each entry is one action, or two run together (DualPipeV's
    overlapped forward+backward)."""
    stages = [_StageLayout(s, pp * virtual, 0, pp) for s in stages_of_rank(0, pp, virtual, schedule)]
    if schedule == "1f1b":
        # Schedule1F1B runs its own loop and its printed table numbers the last rank's
        # micro-batches one too high (torch 2.13); the interleaved schedule with one stage per
        # rank plans exactly the actions Schedule1F1B runs (warm-up pp-rank forwards, then
        # one forward / one backward), and its table is the one its runtime executes.
        cls, target = SCHEDULES["interleaved_1f1b"], stages
    else:
        cls = SCHEDULES[schedule]
        target = stages[0] if schedule in SINGLE_STAGE_SCHEDULES else stages
    order = cls(target, n_microbatches=n_micro).pipeline_order
    table: dict[int, list[list[Action]]] = {}
    for rank, actions in order.items():
        entries = []
        for action in actions:
            if action is None:
                continue
            parts = action.sub_actions if getattr(action, "sub_actions", None) else [action]
            entry = [Action(a.stage_index, _kind(a), a.microbatch_index) for a in parts]
            entry = [a for a in entry if a.kind in DEFAULT_COSTS]  # drop bookkeeping actions
            if entry:
                entries.append(entry)
        table[rank] = entries
    return table


def _kind(action) -> str:
    name = str(action.computation_type)
    return {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}.get(
        name.split(".")[-1], name.split(".")[-1])


@dataclass
class Block:
    rank: int
    start: float
    end: float
    actions: list[Action]


def timeline(table: dict[int, list[list[Action]]], n_stages: int,
             costs: dict[str, float] = DEFAULT_COSTS) -> list[Block]:
    """Replay each rank's actions in order; an action starts when its rank is free and its
    inputs exist. Returns the blocks (for the picture); raises if the table deadlocks."""
    done: dict[tuple[int, str, int], float] = {}
    rank_free = {rank: 0.0 for rank in table}
    position = {rank: 0 for rank in table}
    blocks: list[Block] = []

    def ready_at(action: Action) -> float | None:
        needs = []
        if action.kind == "F" and action.stage > 0:
            needs.append((action.stage - 1, "F", action.micro_batch))
        if action.kind in ("B", "I"):
            needs.append((action.stage, "F", action.micro_batch))
            if action.stage < n_stages - 1:
                needs.append((action.stage + 1, "grad", action.micro_batch))
        if action.kind == "W":
            needs.append((action.stage, "grad", action.micro_batch))
        times = [done.get(n) for n in needs]
        return None if any(t is None for t in times) else max(times, default=0.0)

    remaining = sum(len(v) for v in table.values())
    while remaining:
        progressed = False
        for rank, entries in table.items():
            while position[rank] < len(entries):
                entry = entries[position[rank]]
                starts = [ready_at(a) for a in entry]
                if any(s is None for s in starts):
                    break
                start = max([rank_free[rank], *starts])
                end = start + sum(costs[a.kind] for a in entry)
                for a in entry:
                    done[(a.stage, a.kind, a.micro_batch)] = end
                    if a.kind in ("B", "I"):
                        done[(a.stage, "grad", a.micro_batch)] = end
                blocks.append(Block(rank, start, end, entry))
                rank_free[rank] = end
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule's actions wait on each other forever")
    return blocks


def bubble_fraction(blocks: list[Block]) -> float:
    """Idle share of all ranks' time over the step (the step lasts until the last block ends)."""
    total = max(b.end for b in blocks)
    ranks = {b.rank for b in blocks}
    busy = sum(b.end - b.start for b in blocks)
    return 1.0 - busy / (total * len(ranks))


def schedule_bubble(schedule: str, pp: int, virtual: int, n_micro: int) -> float:
    table = action_table(schedule, pp, virtual, n_micro)
    return bubble_fraction(timeline(table, pp * virtual))
