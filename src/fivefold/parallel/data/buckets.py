"""Gradient buckets: parameters grouped into flat buffers so a few large collectives replace many
small ones, and so a bucket's collective can start as soon as its last gradient is computed."""

from __future__ import annotations

import torch
from torch import nn

from fivefold.parallel.grad_norm import local_tensor

BUCKET_BYTES = 25 * 2**20  # large enough to amortise launch cost, small enough to overlap backward


class Bucket:
    def __init__(self, params: list[nn.Parameter], padded_to: int):
        self.params = params
        self.sizes = [local_tensor(p).numel() for p in params]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(params))]
        self.numel = sum(self.sizes)
        self.padded = -(-self.numel // padded_to) * padded_to  # so the buffer splits evenly over ranks
        self.device = local_tensor(params[0]).device
        self._buffer: torch.Tensor | None = None
        self._ready: set[int] = set()

    @property
    def buffer(self) -> torch.Tensor:
        """The flat fp32 buffer, allocated on first use and kept until `release()`."""
        if self._buffer is None:
            self._buffer = torch.zeros(self.padded, dtype=torch.float32, device=self.device)
        return self._buffer

    @property
    def allocated(self) -> bool:
        return self._buffer is not None

    def release(self) -> None:
        self._buffer = None

    def views(self, flat: torch.Tensor):
        """(param, slice of `flat`) for every parameter, `flat` laid out like this bucket."""
        for param, offset, size in zip(self.params, self.offsets, self.sizes):
            yield param, flat[offset: offset + size]

    def mark_ready(self, param: nn.Parameter) -> None:
        self._ready.add(id(param))

    def mark_all_ready(self) -> None:
        self._ready = {id(p) for p in self.params}

    @property
    def all_ready(self) -> bool:
        return len(self._ready) == len(self.params)

    def reset(self) -> None:
        self._ready = set()

    def pack_grads(self, scale: float = 1.0) -> None:
        for param, view in self.views(self.buffer):
            if param.grad is None:
                view.zero_()
            else:
                view.copy_(local_tensor(param.grad).reshape(-1))
        self.buffer[self.numel:].zero_()
        if scale != 1.0:
            self.buffer.mul_(scale)

    def unpack_grads(self) -> None:
        for param, view in self.views(self.buffer):
            if param.grad is not None:
                local_tensor(param.grad).copy_(view.view_as(local_tensor(param.grad)))

    def unpack_params(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for param, view in self.views(flat):
                local_tensor(param).copy_(view.view_as(local_tensor(param)))

    def pack_params(self, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flat fp32 parameters (padding zeros), without packing the
        rest: a rank's ZeRO chunk of a bucket holding one huge tensor costs only the chunk."""
        flat = torch.zeros(end - start, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for param, offset, size in zip(self.params, self.offsets, self.sizes):
                lo, hi = max(start, offset), min(end, offset + size)
                if lo < hi:
                    flat[lo - start: hi - start].copy_(local_tensor(param).reshape(-1)[lo - offset: hi - offset])
        return flat

    def pack_chunk(self) -> torch.Tensor:
        """This rank's equal chunk of the flat parameters (group_rank of group_size)."""
        size = self.padded // self.group_size
        return self.pack_params(self.group_rank * size, (self.group_rank + 1) * size)


def make_buckets(params: list[nn.Parameter], padded_to: int, bucket_bytes: int = BUCKET_BYTES) -> list[Bucket]:
    """Buckets in reverse parameter order: roughly the order backward produces gradients."""
    buckets, current, size = [], [], 0
    for param in reversed(params):
        current.append(param)
        size += local_tensor(param).numel() * 4
        if size >= bucket_bytes:
            buckets.append(Bucket(current, padded_to))
            current, size = [], 0
    if current:
        buckets.append(Bucket(current, padded_to))
    return buckets
