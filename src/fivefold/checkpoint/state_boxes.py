"""Where this rank's training state lies inside the whole tensors: the boxes a sharded checkpoint
writes and reads (checkpoint/sharded_io.py), for every layout, with no communication.

Names are single-device names: 'model/<name>' for weights and persistent buffers,
'exp_avg/<name>' and 'exp_avg_sq/<name>' for AdamW's moments, 'momentum_buffer/<name>' for
Muon's (train.optimizer = muon). Per layout:
- tensor parallel and FSDP2 (zero 3): parameters and moments are DTensors; DTensor says the
  offset of the local shard;
- expert parallel: expert tensors hold this ep rank's n_experts/ep experts: offset along dim 0;
- zero 1/2 (and zero 0 or dp = 1 under bf16): the fp32 master weights and the moments live in flat
  per-bucket chunks whose edges fall anywhere inside a tensor; a flat range of a tensor is cut into
  at most 2·ndim−1 boxes (`flat_range_boxes`). 'model/<name>' is then the fp32 master, never the
  bf16 parameter, so a bf16 run resumes exactly and any layout reads it;
- pipeline: each rank names only the tensors of its stages. The last stage's copy of a tied
  embedding is not saved (it equals the embedding) and loads from the embedding's entries.
Replicas (dp, cp, the tp ranks of a replicated tensor) declare the same boxes; DCP writes each once.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fivefold.parallel.grad_norm import local_tensor
from fivefold.parallel.pieces import named_params, persistent_buffers, piece_origin
from fivefold.torch_internals import is_traceable_wrapper_subclass
from fivefold.checkpoint.sharded_io import Pieces

ADAM_KEYS = ("exp_avg", "exp_avg_sq")  # AdamW's moments, saved under these names


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a wrapper of one tensor of the same shape and dtype, else `tensor`.
    torchao's FP8 all-gather (train.fp8 under zero 3, parallel/float8.py) wraps FSDP2's weight shards,
    and AdamW's moments made like them, so; a checkpoint holds (and loads into) the plain inside and
    reads back without torchao."""
    if not is_traceable_wrapper_subclass(tensor):
        return tensor
    names, _ = tensor.__tensor_flatten__()
    inner = getattr(tensor, names[0]) if len(names) == 1 else None
    same = inner is not None and inner.shape == tensor.shape and inner.dtype == tensor.dtype
    return inner if same else tensor


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple, tuple, int]]:
    """Cut elements [start, end) of a row-major tensor of `shape` into boxes:
    (offsets, sizes, flat index of the box's first element); each box is contiguous in memory."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,), start)] if shape else [((), (), 0)]
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner
    if first == last:  # inside one slice along dim 0
        return [((first, *o), (1, *s), first * inner + f)
                for o, s, f in flat_range_boxes(shape[1:], start - first * inner, end - first * inner)]
    boxes = []
    if start % inner:  # the partial first slice
        boxes += flat_range_boxes(shape, start, (first + 1) * inner)
        first += 1
    whole_end = (last + 1) * inner if end % inner == 0 else last * inner
    if whole_end > first * inner:  # whole slices in one box
        n = whole_end // inner - first
        boxes.append(((first, *([0] * (len(shape) - 1))), (n, *shape[1:]), first * inner))
    if end % inner:  # the partial last slice
        boxes += flat_range_boxes(shape, last * inner, end)
    return boxes


class StateBoxes:
    """This rank's boxes of the model and optimizer state of a `Parallelized` model."""

    def __init__(self, par):
        self.par = par
        self.params = named_params(par)
        self.names = {id(p): n for n, p in self.params.items()}
        # The last stage's own copy of a tied matrix (copy -> source), saved once as the source.
        pairs = par.pipeline.tied_pairs if par.pipeline is not None else {}
        self.tied_copies = {copy: source for copy, source in pairs.items() if copy in self.params}

    def _key(self, kind: str, name: str) -> str:
        return f"{kind}/{self.tied_copies.get(name, name)}"

    def origin(self, name: str, tensor: torch.Tensor) -> tuple[list[int], list[int]]:
        return piece_origin(name, tensor, self.par.ep_mesh)

    def _add(self, out: dict, key: str, shape, dtype, offsets, tensor: torch.Tensor) -> None:
        out.setdefault(key, Pieces(torch.Size(shape), dtype)).add(offsets, tensor)

    def model(self, for_load: bool = False) -> dict[str, Pieces]:
        """Boxes of the weights: under zero 0/1/2's master chunks (all of bf16 but zero 3, and fp32
        zero 1/2) the fp32 masters, which `after_model_load` then writes into the parameters."""
        out: dict[str, Pieces] = {}
        dp = self.par.data_parallel
        in_chunks = set()
        if hasattr(dp, "chunks"):
            self._chunk_boxes(out, {"model": [chunk.data for chunk in dp.chunks]}, for_load)
            in_chunks = {id(p) for bucket in dp.buckets for p in bucket.params}
        for name, param in self.params.items():
            if (name in self.tied_copies and not for_load) or id(param) in in_chunks:
                continue
            if not param.requires_grad:  # a frozen base (LoRA): it comes back from where it came
                continue
            offsets, shape = self.origin(name, param)
            local = plain(local_tensor(param))
            self._add(out, self._key("model", name), shape, local.dtype, offsets, local.detach())
        for name, buf in persistent_buffers(self.par).items():
            self._add(out, f"model/{name}", buf.shape, buf.dtype, [0] * buf.dim(), buf)
        return out

    def optimizer(self, optimizer: torch.optim.Optimizer, for_load: bool = False) -> dict[str, Pieces]:
        """Boxes of AdamW's moments. For saving they view the optimizer's state (zeros before the
        first step); for loading, fresh zero tensors that `install` hands to the optimizer."""
        dp = self.par.data_parallel
        self._fresh: dict = {}  # optimizer key (param or chunk) -> {moment: tensor}, for install
        out: dict[str, Pieces] = {}
        if hasattr(dp, "chunks"):  # flat master chunks (zero 1/2, and zero 0 under bf16)
            moments = [self._moments(optimizer, chunk, for_load) for chunk in dp.chunks]
            for key in sorted({k for m in moments for k in m}):  # AdamW's, and Muon's chunks' momentum
                self._chunk_boxes(out, {key: [m.get(key) for m in moments]}, for_load)
            return out
        for param in dp.params:
            name = self.names[id(param)]
            if name in self.tied_copies and not for_load:
                continue
            origin, shape = self.origin(name, param)
            for key, moment in self._moments(optimizer, param, for_load).items():
                local = plain(local_tensor(moment))
                self._add(out, self._key(key, name), shape, local.dtype, origin, local)
        return out

    def _chunk_boxes(self, out: dict, flats: dict[str, list[torch.Tensor]], for_load: bool) -> None:
        """Boxes of per-bucket flat tensors laid out like the data-parallel master chunks (`flats`:
        kind -> one flat tensor per bucket), cut where the chunk edges fall inside a tensor."""
        dp = self.par.data_parallel
        for index, bucket in enumerate(dp.buckets):
            size = bucket.padded // bucket.group_size
            lo = bucket.group_rank * size
            for param, offset, numel in zip(bucket.params, bucket.offsets, bucket.sizes):
                name = self.names[id(param)]
                if name in self.tied_copies and not for_load:
                    continue
                start, end = max(lo, offset), min(lo + size, offset + numel)
                origin, shape = self.origin(name, param)
                for box_offsets, sizes, first in flat_range_boxes(tuple(local_tensor(param).shape),
                                                                  start - offset, end - offset):
                    at = [o + b for o, b in zip(origin, box_offsets)]
                    begin = offset + first - lo
                    for key, per_bucket in flats.items():
                        flat = per_bucket[index]
                        if flat is None:  # a bucket of another optimizer: no such state
                            continue
                        view = flat[begin: begin + math.prod(sizes)].view(sizes)
                        self._add(out, self._key(key, name), shape, flat.dtype, at, view)

    def _moments(self, optimizer, key: nn.Parameter, for_load: bool) -> dict[str, torch.Tensor]:
        from fivefold.train.optim import state_keys

        keys = state_keys(optimizer, key)  # AdamW's two moments, or Muon's momentum
        state = optimizer.state.get(key, {})
        if for_load or any(k not in state for k in keys):
            fresh = {k: torch.zeros_like(key) for k in keys}
            if for_load:
                self._fresh[key] = fresh
            return fresh
        return {k: state[k] for k in keys}

    def install(self, optimizer: torch.optim.Optimizer, step: float, fresh: set[str] = frozenset()) -> None:
        """Give the optimizer the moments `optimizer(for_load=True)` made (now filled) and `step`;
        a tensor made only of parameters named in `fresh` (new to their optimizer) counts from 0."""
        group = optimizer.param_groups[0]
        on_device = group.get("fused") or group.get("capturable")  # where AdamW keeps its step count
        optimizer.state.clear()
        for key, moments in self._fresh.items():
            device = local_tensor(key).device if on_device else "cpu"
            count = 0.0 if fresh and set(self._names_in(key)) <= fresh else float(step)
            optimizer.state[key] = {**moments, "step": torch.tensor(count, device=device)}

    def _names_in(self, tensor: torch.Tensor) -> list[str]:
        """The parameters inside an optimizer tensor: one, or a master chunk's bucket's."""
        dp = self.par.data_parallel
        for bucket, chunk in zip(getattr(dp, "buckets", ()), getattr(dp, "chunks", ())):
            if chunk is tensor:
                return [self.names[id(p)] for p in bucket.params]
        return [self.names[id(tensor)]]

    def after_model_load(self) -> None:
        """The parameters from the loaded master chunks (a collective over the chunks' groups)."""
        dp = self.par.data_parallel
        if hasattr(dp, "chunks"):
            with torch.no_grad():
                dp.write_params()


def optimizer_step(optimizer: torch.optim.Optimizer) -> float:
    """AdamW's step count (the same for every tensor: updates are skipped all together)."""
    for state in optimizer.state.values():
        if "step" in state:
            return float(local_tensor(state["step"]) if torch.is_tensor(state["step"]) else state["step"])
    return 0.0
