"""Stable argsorts of small non-negative integer keys, as one value sort of packed keys.

``key << b | index`` (``b`` the bits of the largest index) is unique per item, so sorting its
values orders the items by key, ties by index: exactly ``np.argsort(key, kind="stable")``.
NumPy sorts 32-bit values with its SIMD quicksort, ~3x faster on the 2-core machine than its
stable radix argsort of uint16 keys at 153,600 items (random keys: 0.9 against 3 ms); the
stable argsort stays the fallback when the packed keys need more than 32 bits.
"""

from __future__ import annotations

import numpy as np


def stable_argsort(key: np.ndarray, bound: int) -> np.ndarray:
    """``np.argsort(key, kind="stable")`` as int64, for integer keys in ``0..bound - 1``
    (the caller's guarantee: no check, as ``key`` comes from its own arithmetic)."""
    n = key.size
    b = max(1, (n - 1).bit_length())
    if n == 0 or (max(bound, 1) - 1) << b >= 1 << 32:
        return np.argsort(key.astype(np.uint16) if bound <= 1 << 16 else key, kind="stable")
    packed = key.astype(np.uint32)
    packed <<= b
    packed |= np.arange(n, dtype=np.uint32)
    packed.sort()
    packed &= (1 << b) - 1
    return packed.astype(np.int64)
