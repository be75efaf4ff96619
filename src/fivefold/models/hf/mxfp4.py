"""MXFP4 weights, read as ordinary tensors: what gpt-oss's released checkpoints store for the
experts' projections (OCP Microscaling: 4-bit E2M1 elements sharing one E8M0 power of two per 32).

A quantised weight `<name>` of Hugging Face shape (..., inputs, outputs) is stored as two tensors:
`<name>_blocks`, uint8 (..., outputs, inputs/32, 16), 32 E2M1 codes per group, two per byte, the
low nibble first; and `<name>_scales`, uint8 (..., outputs, inputs/32), each group's exponent
biased by 127. The dequantised weight is code value × 2^(scale − 127) with the last two dimensions
swapped, as transformers dequantises it. Every value is exact in bf16 and fp32.

`MXFP4Slice` answers `get_shape()` and `[box]` like a safetensors slice of the dequantised tensor,
reading and expanding only the groups of that box, a bounded number of rows at a time, so a
training rank dequantises its own shard and nothing else.
"""

from __future__ import annotations

import math

import torch

from fivefold.config import ConfigError

GROUP = 32  # elements sharing one scale
BLOCKS, SCALES = "_blocks", "_scales"  # the suffixes of a quantised weight's two stored tensors
# E2M1: sign, two exponent bits, one mantissa bit; code 8 is -0.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
ROWS_PER_TILE = 4096  # rows of 32-element groups expanded at once: bounds the index temporaries
NAN_SCALE = 255  # E8M0's only non-number


def dequantise(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., groups, 16) uint8 codes and (..., groups) exponents -> (..., groups·32) values, in the
    stored order (not transposed)."""
    groups = blocks.reshape(-1, blocks.shape[-1])
    exponents = scales.reshape(-1, 1)
    out = torch.empty(groups.shape[0], 2 * groups.shape[1], dtype=dtype)
    for start in range(0, groups.shape[0], ROWS_PER_TILE):
        tile = groups[start:start + ROWS_PER_TILE].to(torch.int64)
        codes = torch.stack((tile & 0x0F, tile >> 4), dim=-1).flatten(-2)  # low nibble first
        power = torch.exp2(exponents[start:start + ROWS_PER_TILE].to(torch.float32) - 127)
        out[start:start + ROWS_PER_TILE] = E2M1[codes] * power  # exact: a power of two times E2M1
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 2 * blocks.shape[-1])


class MXFP4Slice:
    """The dequantised Hugging Face tensor (..., inputs, outputs) of a `_blocks`/`_scales` pair of
    safetensors slices, read box by box."""

    def __init__(self, name: str, blocks, scales, dtype: torch.dtype):
        self.name, self.blocks, self.scales, self.dtype = name, blocks, scales, dtype
        shape, scale_shape = list(blocks.get_shape()), list(scales.get_shape())
        if blocks.get_dtype() != "U8" or scales.get_dtype() != "U8":
            raise ConfigError(f"{name}{BLOCKS} and {name}{SCALES} must be uint8 (MXFP4), got "
                              f"{blocks.get_dtype()} and {scales.get_dtype()}")
        if len(shape) < 3 or shape[-1] != GROUP // 2 or shape[:-1] != scale_shape:
            raise ConfigError(f"{name}{BLOCKS} has shape {shape} and {name}{SCALES} {scale_shape}; MXFP4 "
                              f"stores (..., rows, groups, {GROUP // 2}) bytes and (..., rows, groups) scales")
        *self.lead, self.rows, self.groups, _ = shape

    def get_shape(self) -> list[int]:
        return [*self.lead, self.groups * GROUP, self.rows]

    def __getitem__(self, box: tuple[slice, ...]) -> torch.Tensor:
        shape = self.get_shape()
        ranges = [range(*s.indices(n)) for s, n in zip(box, shape)]
        if len(ranges) != len(shape) or any(r.step != 1 for r in ranges):
            raise ValueError(f"{self.name}: an MXFP4 tensor reads contiguous boxes of all {len(shape)} dimensions")
        *lead, inputs, rows = ranges
        first, last = inputs.start // GROUP, math.ceil(inputs.stop / GROUP)  # the groups the box touches
        stored = (*[slice(r.start, r.stop) for r in lead], slice(rows.start, rows.stop), slice(first, last))
        exponents = self.scales[stored]
        if (exponents == NAN_SCALE).any():
            raise ConfigError(f"{self.name}{SCALES} holds the E8M0 NaN scale {NAN_SCALE}; the checkpoint is damaged")
        values = dequantise(self.blocks[stored], exponents, self.dtype)
        skip = inputs.start - first * GROUP
        return values[..., skip:skip + len(inputs)].transpose(-2, -1)


def quantised_pairs(names) -> dict[str, tuple[str, str]]:
    """Weight name -> its (`_blocks`, `_scales`) tensor names, for every pair among `names`."""
    names = set(names)
    return {name[:-len(BLOCKS)]: (name, name[:-len(BLOCKS)] + SCALES) for name in names
            if name.endswith(BLOCKS) and name[:-len(BLOCKS)] + SCALES in names}
