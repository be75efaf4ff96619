"""A seeded permutation of [0, n) that is computed index by index, never materialised.

A corpus of billions of tokens has hundreds of millions of windows; `randperm` over them would cost
every rank gigabytes and seconds at start-up, growing with the corpus. A Feistel network is a
bijection on [0, 2^bits) for any round function; walking the cycle (applying it again while the
result is >= n) turns it into a bijection on [0, n). Each lookup costs a few integer hashes, so
the order of an epoch is a function of (seed, n) alone, whatever part of it a rank asks for.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a well-spread 64-bit hash (uint64 arithmetic wraps by design)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _feistel(x: np.ndarray, keys: np.ndarray, half_bits: int) -> np.ndarray:
    shift, mask = np.uint64(half_bits), np.uint64((1 << half_bits) - 1)
    left, right = x >> shift, x & mask
    for r in range(ROUNDS):
        round_key = _mix(keys + np.uint64(r) * _GOLDEN)
        left, right = right, left ^ (_mix(right ^ round_key) & mask)
    return (left << shift) | right


def permute(n: int, seed: int, epochs: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Element `positions[i]` of epoch `epochs[i]`'s permutation of [0, n), for each i."""
    if n <= 1:
        return np.zeros(len(positions), dtype=np.int64)
    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)  # a square domain 2^(2*half) >= n
    with np.errstate(over="ignore"):
        keys = _mix(np.uint64(seed & (2**64 - 1)) * _GOLDEN + _mix(np.asarray(epochs, dtype=np.uint64) + _GOLDEN))
        x = np.asarray(positions, dtype=np.uint64).copy()
        outside = np.ones(len(x), dtype=bool)
        while outside.any():  # cycle walking: the domain is < 4n, so a few rounds at most on average
            x[outside] = _feistel(x[outside], keys[outside], half_bits)
            outside = x >= np.uint64(n)
    return x.astype(np.int64)
