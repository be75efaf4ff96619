"""The communication ledger: bytes this rank sends per step in each parallel dimension, measured.

While a step runs, a dispatch mode sees every collective that reaches PyTorch's dispatcher — ours,
FSDP2's and DTensor's alike — with its tensors and its process group. The group says which
dimension it belongs to (tp, dp, ...); the tensor sizes give the bytes a rank sends under the ring
algorithms (all-reduce 2(N-1)/N of the buffer; reduce-scatter, all-gather and all-to-all (N-1)/N of
the full buffer; point-to-point the whole tensor). Groups not named by the mesh (e.g. the world
group of the gradient-norm all-reduce) are counted under "other".

A group is recognised by its name, else by its members: DTensor caches sharding decisions per
mesh shape, so a second run in one process may reach the same ranks through an earlier run's group.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from fivefold.torch_internals import HigherOrderOperator, TorchDispatchMode, op_schema_name, resolve_process_group


def _group_of(arg) -> tuple[str, int] | None:
    """(group name, size) from a c10d op's ProcessGroup or a functional op's group name."""
    if isinstance(arg, torch.ScriptObject):
        try:
            group = dist.ProcessGroup.unbox(arg)
        except (RuntimeError, TypeError):
            return None
        return group.group_name, group.size()
    return None


def _functional_group_size(name: str) -> int:
    return resolve_process_group(name).size()


def group_ranks(name: str) -> tuple[int, ...]:
    """The sorted global ranks of a process group, by its name."""
    return tuple(sorted(dist.get_process_group_ranks(resolve_process_group(name))))


def _nbytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, (list, tuple)):
        return sum(_nbytes(t) for t in tensors)
    return 0


# Bytes a rank sends, as a fraction of the named tensor's bytes: op name -> (which arg, rule).
# Rules: "ar" 2(N-1)/N, "full" (N-1)/N of a full buffer, "shard" (N-1) x the per-rank shard, "p2p" 1.
_C10D = {
    "allreduce_": (0, "ar"), "_allgather_base_": (1, "shard"), "allgather_": (1, "shard"),
    "allgather_into_tensor_coalesced_": (1, "shard"), "_reduce_scatter_base_": (1, "full"),
    "reduce_scatter_": (1, "full"), "reduce_scatter_tensor_coalesced_": (1, "full"),
    "alltoall_base_": (1, "full"), "alltoall_": (1, "full"), "send": (0, "p2p"),
}
_FUNCTIONAL = {
    "all_reduce": (0, "ar"), "all_reduce_coalesced": (0, "ar"), "all_gather_into_tensor": (0, "shard"),
    "all_gather_into_tensor_coalesced": (0, "shard"), "reduce_scatter_tensor": (0, "full"),
    "reduce_scatter_tensor_coalesced": (0, "full"), "all_to_all_single": (0, "full"),
}


def _sent(rule: str, nbytes: int, n: int) -> float:
    if rule == "ar":
        return 2 * (n - 1) / n * nbytes
    if rule == "full":
        return (n - 1) / n * nbytes
    if rule == "shard":
        return (n - 1) * nbytes
    return float(nbytes)


_MISSING = object()
_ENTRIES: dict = {}  # operator overload -> (functional?, which arg, rule), or None: not a collective


def _entry(func):
    namespace, name = func.namespace, op_schema_name(func).split("::")[-1]
    if namespace == "c10d" and name in _C10D:
        return (False, *_C10D[name])
    if namespace == "_c10d_functional" and name in _FUNCTIONAL:
        return (True, *_FUNCTIONAL[name])
    return None


class CommLedger(TorchDispatchMode):
    """Use as a context around a step; `take()` returns {dimension: bytes} and starts afresh."""

    def __init__(self, group_dims: dict[str, str] | None = None):
        super().__init__()
        self.group_dims = group_dims or {}  # process-group name -> dimension label
        self._bytes: dict[str, float] = defaultdict(float)
        self._labels: dict[str, str] = {}  # group name -> label, filled on first sight

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Compiled blocks (train.compile) run compiled under the ledger, which sees the collectives
        # their graphs call at run time. Without this, Dynamo falls back to eager for a call made
        # inside the mode and never compiles that code again: the first step is measured, so no
        # multi-rank run compiled anything (tests/test_data_parallel.py has the Inductor case).
        return True

    # A compiled graph with recomputation inside calls higher-order operators (run_and_save_rng_state):
    # they run as they are, and the collectives inside them reach this mode as ordinary operators.
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(func, HigherOrderOperator):
            return out
        # This runs for every operator of the step; almost none is a collective. One dict lookup
        # per operator (cached by overload) keeps the ledger's cost per op small.
        entry = _ENTRIES.get(func, _MISSING)
        if entry is _MISSING:
            entry = _ENTRIES[func] = _entry(func)
        if entry is None:
            return out
        functional, which, rule = entry
        if not functional:
            group = next((g for g in map(_group_of, args) if g is not None), None)
            if group is not None:
                self._add(group[0], _sent(rule, _nbytes(args[which]), group[1]))
        else:
            group_name = next(a for a in reversed(args) if isinstance(a, str))
            self._add(group_name, _sent(rule, _nbytes(args[which]), _functional_group_size(group_name)))
        return out

    def _add(self, group_name: str, nbytes: float) -> None:
        label = self._labels.get(group_name)
        if label is None:
            label = self.group_dims.get(group_name)
            if label is None:  # not one of this run's groups: one with the same members
                by_members = {group_ranks(name): dim for name, dim in self.group_dims.items()}
                label = by_members.get(group_ranks(group_name), "other")
            self._labels[group_name] = label
        self._bytes[label] += nbytes

    def take(self) -> dict[str, int]:
        out = {dim: int(round(n)) for dim, n in sorted(self._bytes.items())}
        self._bytes.clear()
        return out
