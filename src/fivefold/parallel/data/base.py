"""The data-parallel interface every variant implements, and the variant for a layout without
data parallelism (dp·cp = 1): gradients stay where backward left them."""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch import nn

from fivefold.mesh import ParallelDims
from fivefold.parallel.data.buckets import Bucket, make_buckets
from fivefold.parallel.expert.apply import is_expert_param
from fivefold.parallel.grad_norm import (
    clip_coefficient,
    copies_of_local_piece,
    global_norm,
    local_tensor,
    settle_grad_layout,
    weighted_square_sum,
)


def local_row_factor(param: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The factors of this rank's piece of `param` (its local shape) when row i of the whole is
    multiplied by rows[i]: a DTensor's piece takes the rows its placements give it (a local slice
    of the expanded factors, no communication)."""
    from torch.distributed.tensor import DTensor, Replicate

    whole = rows.to(local_tensor(param).dtype).view(-1, *[1] * (param.dim() - 1)).expand(param.shape)
    if not isinstance(param, DTensor):
        return whole
    mesh = param.device_mesh
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, param.placements).to_local()


def trainable(parts: list[nn.Module]) -> list[nn.Parameter]:
    """Each trainable parameter once, even when two parts (pipeline stages) share it."""
    seen, params = set(), []
    for part in parts:
        for param in part.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


class DataParallel:
    """Whole-tensor gradients and optimizer (no data parallelism: dp = 1).

    `parts` are this rank's model parts: the model, or the pipeline stages this rank runs."""

    name = "no data parallelism"

    def __init__(self, parts: list[nn.Module], dims: ParallelDims):
        self.parts, self.dims = parts, dims
        self.params = trainable(parts)
        self.norm_world = dims.world_size // dims.pp  # ranks that together hold one full model
        # Parameters held on more ranks than the layout says (a tied embedding split across the
        # first and last pipeline stage): id -> extra factor on their copies.
        self.extra_copies: dict[int, int] = {}
        # Expert parameters under expert parallelism: each ep rank holds different experts, and their
        # gradients meet over the expert-data-parallel group instead of dp·cp (parallel/expert/apply.py).
        self.expert_ids = ({id(p) for part in parts for n, p in part.named_parameters() if is_expert_param(n)}
                           if dims.ep > 1 else set())
        self._settings: dict[int, object] = {}  # id(param) -> its optimizer settings (set_settings)

    def set_settings(self, by_name: dict | None) -> None:
        """The optimizer settings of each parameter (config/param_groups.py), by single-device
        name: what `settings_of` answers. None: every tensor gets the optimizer's base settings."""
        self._settings = {id(p): by_name[n] for part in self.parts
                          for n, p in part.named_parameters(remove_duplicate=False)} if by_name else {}

    def settings_of(self, tensor: torch.Tensor):
        """The settings of a tensor `build_optimizer` handed out (None: the base settings)."""
        return self._settings.get(id(tensor))

    def copies(self, param: torch.Tensor) -> int:
        copies = copies_of_local_piece(param, self.norm_world) * self.extra_copies.get(id(param), 1)
        return copies // self.dims.ep if id(param) in self.expert_ids else copies

    def reduction_buckets(self, padded_to, group, group_rank, expert_group, expert_rank,
                          params=None) -> list[Bucket]:
        """Buckets of dense parameters, reduced over `group`, and apart of expert parameters, reduced
        over the expert-data-parallel group. Every gradient is divided by all dp·cp ranks: an expert
        already summed the tokens of its whole ep group. Each bucket carries its group, its size,
        this rank's place in it (None: not needed) and the gradient scale. `params`: a subset of
        this rank's parameters (default all)."""
        params = self.params if params is None else params
        dense = [p for p in params if id(p) not in self.expert_ids]
        expert = [p for p in params if id(p) in self.expert_ids]
        buckets = []
        for params, grp, rank, is_expert in ((dense, group, group_rank, False), (expert, expert_group, expert_rank, True)):
            if not params:
                continue
            size = dist.get_world_size(grp) if grp is not None else 1  # None: this rank alone
            pad = size if padded_to is None else padded_to
            for bucket in self._buckets_by_settings(params, pad):
                bucket.group, bucket.group_size, bucket.group_rank = grp, size, rank
                bucket.is_expert = is_expert
                bucket.scale = 1.0 / (self.dims.dp * self.dims.cp)  # HSDP's replica all-reduce adds, too
                buckets.append(bucket)
        return buckets

    def _buckets_by_settings(self, params: list[nn.Parameter], padded_to: int) -> list[Bucket]:
        """Buckets that never hold two optimizer settings (a ZeRO chunk is then one optimizer
        tensor with one group's settings, however it cuts through tensors), in the order backward
        completes them: by their earliest parameter, last first."""
        order = {id(p): i for i, p in enumerate(params)}
        kinds: dict = {}
        for param in params:
            kinds.setdefault(self._settings.get(id(param)), []).append(param)
        buckets = [b for same in kinds.values() for b in make_buckets(same, padded_to=padded_to)]
        return sorted(buckets, key=lambda b: -min(order[id(p)] for p in b.params))

    @contextlib.contextmanager
    def grad_sync(self, is_last: bool):
        """Wraps one micro-batch's forward and backward; `is_last` marks the step's last one."""
        self.begin_micro_batch(is_last)
        yield
        self.end_micro_batch()

    def begin_micro_batch(self, is_last: bool) -> None:
        pass

    def sum_tied(self, pipeline, group) -> None:
        """Sum the gradients of a pipeline's tied embedding copies (`group`: the ranks holding them)."""
        pipeline.sum_tied_grads(group)

    def end_micro_batch(self) -> None:
        pass

    def finish_grads(self) -> None:
        for param in self.params:
            settle_grad_layout(param)

    def clip_grad_norm(self, max_norm: float) -> float:
        with_grads = [p for p in self.params if p.grad is not None]
        grads = [p.grad for p in with_grads]
        norm = global_norm(weighted_square_sum([(local_tensor(p.grad), self.copies(p)) for p in with_grads]))
        coefficient = clip_coefficient(norm, max_norm)
        if coefficient < 1.0:
            torch._foreach_mul_([local_tensor(g) for g in grads], coefficient)
        return norm

    def build_optimizer(self, make_optimizer) -> torch.optim.Optimizer:
        """`make_optimizer(tensors)` builds the optimizer over the tensors this rank updates."""
        return make_optimizer(self.params)

    def muon_layout(self):
        """How Muon finds whole matrices in the tensors this rank updates: DTensors (tensor
        parallel, FSDP2) are gathered to an owner (parallel/muon_dtensor.py); plain tensors hold their own."""
        from fivefold.parallel.muon_dtensor import DTensorMatrices

        return DTensorMatrices([p for p in self.params if getattr(self.settings_of(p), "optimizer", "") == "muon"])

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    @torch.no_grad()
    def scale_rows(self, row_scales: dict[nn.Parameter, torch.Tensor]) -> None:
        """Multiply each given parameter's rows by a factor ((rows,) of its whole shape) in the
        weights this rank keeps (QK-clip, parallel/qk_clip.py). Here the parameters are their own
        masters: whole tensors, or DTensor pieces (tp, FSDP2) that take their rows' factors."""
        for param, rows in row_scales.items():
            local_tensor(param).mul_(local_row_factor(param, rows))

    def gradient_buffers(self) -> list[torch.Tensor]:
        """Gradient storage beyond `param.grad` (flat buckets, sharded gradients)."""
        return []

    def master_weights(self) -> dict[int, torch.Tensor]:
        """id(param) -> fp32 master of this rank's local piece, where the parameter is not its own
        master (bf16 weights); a collective where masters are sharded. Here: none."""
        return {}

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank holds now for parameters, gradients and optimizer state (incl. masters).
        Memory viewed by several tensors (a master chunk's gradient inside its bucket) counts once."""
        def size(tensors) -> int:
            spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                           for t in map(local_tensor, tensors) if t.numel())
            total, reached = 0, 0
            for start, end in spans:  # the length of the union of the spans
                total += max(0, end - max(start, reached))
                reached = max(reached, end)
            return total

        state = [v for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        masters = [p for group in optimizer.param_groups for p in group["params"]
                   if not any(p is q for q in self.params)]
        held = [p for part in self.parts for p in part.parameters()]  # trained, and a frozen base (LoRA)
        return {"params": size(held),
                "grads": size([p.grad for p in self.params if p.grad is not None] + self.gradient_buffers()),
                "optimizer": size(state) + size(masters)}


def weak_pair(owner, bucket) -> tuple[weakref.ref, weakref.ref]:
    """What a gradient hook on a parameter may hold of its data-parallel owner and bucket: weak
    references. The tensor's C++ autograd metadata holds the hook, an edge Python's garbage
    collector cannot see, so a hook holding them strongly (owner -> bucket -> parameter -> hook)
    is a cycle never freed: the model, its optimizer state and its process groups (two gloo
    threads per group) would outlive the run in every process that trains more than once."""
    return weakref.ref(owner), weakref.ref(bucket)
