"""Hot-expert replicas (ours, `parallel.ep_replicas`): copies of the most loaded experts on the
least loaded ep ranks, so that a skewed router does not leave one ep rank computing most rows.

Each ep rank of an MoE layer has `ep_replicas` slots; a slot holds a copy of an expert another ep
rank owns. The math stays exactly that of the run without replicas:
- Rows: an expert with c copies (its owner first, then the slot holders in rank order) has each
  source rank's rows for it cut into c contiguous pieces, piece j going to copy j. Every row meets
  the same weights and its output comes back to the place it left (parallel/expert/apply.py).
- Weights: slots are not parameters (the optimizer, checkpoints and the gradient norm never see
  them). After every optimizer step each slot is refreshed from its owner (an all-to-all over ep).
- Gradients: a slot's weights enter the forward through `ReplicaWeights`, whose backward sends the
  slot's gradient to the owner (the reverse all-to-all) and adds it to the owner's expert gradient
  inside the same backward pass. So the owner's parameter gradient is whole when autograd
  accumulates it, before any data-parallel hook reduces it (zero 0 launches its all-reduces from
  such hooks during the last micro-batch's backward, so a fold after backward would come too late).
- Plan: every `ep_rebalance_every` optimizer steps, from the global load summed since the last
  plan (the same on every rank), greedily: the expert with the highest load per copy gets a copy
  on the least loaded rank with a free slot that does not hold it, while that lowers the rank loads
  sorted highest first (rank load = sum over the copies it holds of load / copies).
Checkpoint-safe: slots are derived state; a resumed run starts without them and plans again at its
next multiple of `ep_rebalance_every` (the optimizer's step count, which checkpoints restore).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fivefold.parallel.step_hooks import StepHook

EMPTY = -1  # a slot holding no expert


class ReplicaSlots:
    """One MoE layer's replica slots on one ep rank (which owns experts [rank·n_local, +n_local))."""

    def __init__(self, experts: nn.Module, group, n_local: int, n_slots: int):
        self.experts, self.group, self.n_local, self.n_slots = experts, group, n_local, n_slots
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.slots: list[list[int]] | None = None  # per ep rank, the expert in each slot; None: no replicas
        self.cache: dict[str, torch.Tensor] = {}  # parameter name -> (n_slots, ...) copies held here
        self.load: torch.Tensor | None = None  # global load per expert summed since the last plan
        self.rows = 0  # rows this rank's slots computed (with gradients), for tests and benchmarks

    # --- the plan ----------------------------------------------------------------------------
    def owner(self, expert: int) -> int:
        return expert // self.n_local

    def holders(self, expert: int) -> list[int]:
        """The ranks computing `expert`'s rows: its owner, then the slot holders in rank order."""
        return [self.owner(expert)] + [r for r in range(self.ep) if self.slots and expert in self.slots[r]]

    def observe(self, load: torch.Tensor) -> None:
        load = load.double().cpu()
        self.load = load if self.load is None else self.load + load

    def replan(self) -> None:
        if self.load is not None:
            self.slots = greedy_plan(self.load.tolist(), self.ep, self.n_local, self.n_slots)
        self.load = None

    def rank_loads(self, load: list[float]) -> list[float]:
        """What each ep rank computes of `load` under the plan in effect."""
        return rank_loads(load, self.ep, self.n_local, self.slots)

    # --- the dispatch ------------------------------------------------------------------------
    def split(self, counts: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """This rank's rows (sorted by expert, counts[e] each) as columns per destination rank:
        its owned experts, then its slots. Returns the rows per column, destination-major, and the
        row order that lays them out so (None without replicas: the columns are `counts`)."""
        if self.slots is None:
            return counts, None
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        columns, pieces = [], []
        for dest in range(self.ep):
            owned = range(dest * self.n_local, (dest + 1) * self.n_local)
            for expert in [*owned, *self.slots[dest]]:
                if expert == EMPTY:
                    columns.append(0)
                    continue
                holders = self.holders(expert)
                n, c, j = counts[expert], len(holders), holders.index(dest)
                size = n // c + (1 if j < n % c else 0)
                first = starts[expert] + j * (n // c) + min(j, n % c)
                columns.append(size)
                pieces.append(torch.arange(first, first + size))
        order = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
        return columns, order

    def run(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The slots' experts on `rows` (grouped by slot, counts[s] each), through the experts
        module with the slot copies in place of its parameters."""
        names = [name for name, _ in self.experts.named_parameters(recurse=False)]
        owned = [getattr(self.experts, name) for name in names]
        weights = ReplicaWeights.apply(self, *owned)
        if torch.is_grad_enabled():
            self.rows += rows.shape[0]
        return torch.func.functional_call(self.experts, dict(zip(names, weights)), (rows, counts))

    # --- weights and gradients ----------------------------------------------------------------
    @torch.no_grad()
    def refresh(self) -> None:
        """Copy every slot's expert from its owner (a collective over ep)."""
        if self.slots is None:
            return
        params = dict(self.experts.named_parameters(recurse=False))
        if not self.cache:
            self.cache = {name: p.new_zeros((self.n_slots, *p.shape[1:])) for name, p in params.items()}
        sent = [[_pack([p[e - self.rank * self.n_local] for p in params.values()])
                 for e in self.slots[dest] if e != EMPTY and self.owner(e) == self.rank]
                for dest in range(self.ep)]
        got = self._exchange(sent, [self._per_expert() * sum(e != EMPTY and self.owner(e) == src
                                                              for e in self.slots[self.rank])
                                    for src in range(self.ep)])
        taken = [0] * self.ep
        for slot, expert in enumerate(self.slots[self.rank]):
            if expert == EMPTY:
                continue
            src = self.owner(expert)
            piece = got[src][taken[src] * self._per_expert():(taken[src] + 1) * self._per_expert()]
            taken[src] += 1
            _unpack(piece, [self.cache[name][slot] for name in params])

    def fold_grads(self, grads: list[torch.Tensor], owned: list[torch.Tensor]) -> list[torch.Tensor]:
        """Slot gradients (n_slots, ...) -> their owners: the gradients this rank adds to its own
        experts (n_local, ...), from every other rank's slots (a collective over ep)."""
        mine = self.slots[self.rank]
        sent = [[_pack([g[slot] for g in grads]) for slot, e in enumerate(mine)
                 if e != EMPTY and self.owner(e) == dest] for dest in range(self.ep)]
        got = self._exchange(sent, [self._per_expert() * sum(e != EMPTY and self.owner(e) == self.rank
                                                              for e in self.slots[src])
                                    for src in range(self.ep)])
        out = [torch.zeros_like(p) for p in owned]
        for src in range(self.ep):
            taken = 0
            for e in self.slots[src]:
                if e == EMPTY or self.owner(e) != self.rank:
                    continue
                piece = got[src][taken * self._per_expert():(taken + 1) * self._per_expert()]
                taken += 1
                extra = [torch.empty_like(o[0]) for o in out]
                _unpack(piece, extra)
                for o, x in zip(out, extra):
                    o[e - self.rank * self.n_local] += x
        return out

    def _per_expert(self) -> int:
        return sum(p[0].numel() for p in self.experts.parameters(recurse=False))

    def _exchange(self, sent: list[list[torch.Tensor]], recv_sizes: list[int]) -> list[torch.Tensor]:
        """Uneven all-to-all of flat pieces: sent[dest] -> the flat block received from each rank."""
        like = next(self.experts.parameters(recurse=False))
        flat = [torch.cat(p) if p else like.new_zeros(0) for p in sent]
        out = like.new_empty(sum(recv_sizes))
        dist.all_to_all_single(out, torch.cat(flat), recv_sizes, [f.numel() for f in flat], group=self.group)
        return list(out.split(recv_sizes))


class ReplicaWeights(torch.autograd.Function):
    """The slot copies as a function of the owners' expert parameters: forward returns the copies
    (refreshed after every step, so equal to the owners' weights); backward sends the slots'
    gradients to the owners and returns them as gradients of the owners' parameters."""

    @staticmethod
    def forward(ctx, slots: ReplicaSlots, *owned):
        ctx.slots = slots
        ctx.owned_meta = owned
        return tuple(slots.cache[name].clone() for name, _ in slots.experts.named_parameters(recurse=False))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.slots.fold_grads(list(grads), list(ctx.owned_meta)))


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: torch.Tensor, into: list[torch.Tensor]) -> None:
    offset = 0
    for t in into:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def rank_loads(load: list[float], ep: int, n_local: int, slots: list[list[int]] | None) -> list[float]:
    """Per ep rank: the load of its copies, each expert's load shared evenly by its copies."""
    holders = [[e // n_local] for e in range(len(load))]
    for rank, held in enumerate(slots or []):
        for e in held:
            if e != EMPTY:
                holders[e].append(rank)
    out = [0.0] * ep
    for e, ranks in enumerate(holders):
        for rank in ranks:
            out[rank] += load[e] / len(ranks)
    return out


def greedy_plan(load: list[float], ep: int, n_local: int, n_slots: int) -> list[list[int]] | None:
    """Slots per ep rank (EMPTY-padded), or None when no copy helps. The hottest expert per copy
    first, onto the least loaded rank that can take it; a move is kept only if it lowers the rank
    loads sorted highest first (lexicographically): the highest, or, where several ranks tie at
    the highest, their number, so that two equally busy ranks are relieved one after the other."""
    slots: list[list[int]] = [[] for _ in range(ep)]
    copies = [1] * len(load)
    while True:
        current = rank_loads(load, ep, n_local, slots)
        for expert in sorted(range(len(load)), key=lambda e: (-load[e] / copies[e], e)):
            free = [r for r in range(ep) if len(slots[r]) < n_slots and r != expert // n_local
                    and expert not in slots[r]]
            if not free:
                continue
            target = min(free, key=lambda r: (current[r], r))
            slots[target].append(expert)
            if _lower(rank_loads(load, ep, n_local, slots), current):
                copies[expert] += 1
                break
            slots[target].pop()
        else:
            break
    if not any(slots):
        return None
    return [held + [EMPTY] * (n_slots - len(held)) for held in slots]


def _lower(loads: list[float], than: list[float]) -> bool:
    """Whether `loads`, sorted highest first, is lexicographically below `than` (beyond rounding)."""
    eps = 1e-9 * max(max(than), 1e-30)
    for a, b in zip(sorted(loads, reverse=True), sorted(than, reverse=True)):
        if abs(a - b) > eps:
            return a < b
    return False


def replica_slots(parts: list[nn.Module]) -> list[ReplicaSlots]:
    """Every MoE layer's slots on this rank (empty without `parallel.ep_replicas`)."""
    from fivefold.models.moe.layer import moe_layers

    found = []
    for part in parts:
        for moe in moe_layers(part):
            slots = getattr(moe.run_experts, "replicas", None)
            if slots is not None:
                found.append(slots)
    return found


def after_optimizer_step(parts: list[nn.Module], every: int, optimizer: torch.optim.Optimizer) -> None:
    """Re-plan every `every` optimizer steps (the optimizer's count: a resumed run keeps it), then
    refresh every slot from the updated owners."""
    step = optimizer_steps(optimizer)
    for slots in replica_slots(parts):
        if step % every == 0:
            slots.replan()
        slots.refresh()


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


class ReplicaStep(StepHook):
    """Hot-expert replicas in a step: after each optimizer step, re-plan from the load every
    `every` steps and copy the updated owners into their replicas (after_optimizer_step)."""

    def __init__(self, every: int):
        self.every = every

    def after_optimizer_step(self, par, optimizer) -> dict:
        after_optimizer_step(par.parts, self.every, optimizer)
        return {}
