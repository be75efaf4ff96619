"""Initial weights as a function of (seed, parameter name, whole shape) that any rectangular piece
of a tensor can be computed from alone.

A rank of a large layout holds pieces of tensors (tensor-parallel rows or columns, FSDP rows, a
range of experts); it must not build whole tensors to cut its piece out. So a tensor's values are
defined tile by tile: the whole tensor is cut into tiles of TILE_ROWS x TILE_COLS over its last two
dims (one index at a time over any leading dims, e.g. experts; TILE_ROWS*TILE_COLS elements for a
1-D tensor), and each tile draws from its own generator, seeded by (seed, name, tile index). A
piece then costs the tiles it overlaps, at most one tile (4 MiB) beyond the piece per tile it cuts.

The first tile's generator is seeded by (seed, name) alone, so a tensor no larger than one tile
(every tiny test model's dense weights) draws its values from one generator of (seed, name).
"""

from __future__ import annotations

import itertools
import zlib
from typing import Callable

import torch

TILE_ROWS = TILE_COLS = 1024

# fill(name, whole_shape, offsets, sizes) -> the elements [offsets, offsets + sizes) of the whole
# tensor `name` (single-device name), on the CPU. Seeded initialisation and Hugging Face slice
# readers both have this shape; parallel/materialize.py calls it for every piece a rank holds.
Fill = Callable[[str, tuple, tuple, tuple], torch.Tensor]


def tile_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) == 0:
        return ()
    if len(shape) == 1:
        return (TILE_ROWS * TILE_COLS,)
    return (1,) * (len(shape) - 2) + (TILE_ROWS, TILE_COLS)


def _generator(seed: int, name: str, tile: tuple[int, ...]) -> torch.Generator:
    base = seed * 1_000_003 + zlib.crc32(name.encode())
    if any(tile):
        base = base * 1_000_033 + zlib.crc32(",".join(map(str, tile)).encode())
    return torch.Generator().manual_seed(base % 2**63)


def seeded_normal(seed: int, name: str, shape, std: float, offsets=None, sizes=None) -> torch.Tensor:
    """N(0, std²) values of the box [offsets, offsets + sizes) of the whole tensor `name` of
    `shape` (the whole tensor by default), equal to the same box cut from the whole tensor."""
    return _tiled(torch.randn, seed, name, shape, offsets, sizes).mul_(std)


def seeded_uniform(seed: int, name: str, shape, bound: float, offsets=None, sizes=None) -> torch.Tensor:
    """U(-bound, bound) values of a box of the whole tensor `name`, tile by tile as `seeded_normal`."""
    return _tiled(torch.rand, seed, name, shape, offsets, sizes).mul_(2 * bound).sub_(bound)


def _tiled(draw, seed: int, name: str, shape, offsets=None, sizes=None) -> torch.Tensor:
    """The box [offsets, offsets + sizes) of the whole tensor whose every tile is `draw(extent,
    generator=...)` from the tile's own generator."""
    shape = tuple(shape)
    offsets = tuple(offsets) if offsets is not None else (0,) * len(shape)
    sizes = tuple(sizes) if sizes is not None else shape
    out = torch.empty(sizes)
    if out.numel() == 0:
        return out
    tiles = tile_shape(shape)
    ranges = [range(o // t, (o + s - 1) // t + 1) for o, s, t in zip(offsets, sizes, tiles)]
    for tile in itertools.product(*ranges):
        start = [i * t for i, t in zip(tile, tiles)]
        extent = [min(t, n - s) for t, n, s in zip(tiles, shape, start)]
        values = draw(extent, generator=_generator(seed, name, tile))
        # The overlap of this tile with the box, in tile and in box coordinates.
        lo = [max(s, o) for s, o in zip(start, offsets)]
        hi = [min(s + e, o + n) for s, e, o, n in zip(start, extent, offsets, sizes)]
        in_tile = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start))
        in_box = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))
        out[in_box] = values[in_tile]
    return out


def constant(value: float, sizes) -> torch.Tensor:
    return torch.full(tuple(sizes), value)


def fill_whole(model, fill: Fill) -> None:
    """Give every parameter of a single-device model its whole value from `fill`."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(fill(name, tuple(param.shape), (0,) * param.dim(), tuple(param.shape)))
