"""Stable argsorts of small non-negative integer keys.

Keys below 2^16 go through NumPy's stable argsort of uint16, a radix sort: O(n), and on the
2-core machine with NumPy 2.4 the fastest way (2,560 slot keys over 153,600 items: 0.6 to 1.5
ms, against 3.6 ms for a value sort of packed ``key << b | index`` 32-bit keys and 7 ms for a
stable argsort of int64). Larger keys are packed that way when they fit 32 bits (unique per
item, so the value sort orders by key, ties by index: exactly ``np.argsort(key,
kind="stable")``); the plain stable argsort is the last fallback.
"""

from __future__ import annotations

import numpy as np


def stable_argsort(key: np.ndarray, bound: int) -> np.ndarray:
    """``np.argsort(key, kind="stable")`` as int64, for integer keys in ``0..bound - 1``
    (the caller's guarantee: no check, as ``key`` comes from its own arithmetic)."""
    n = key.size
    if bound <= 1 << 16:
        return np.argsort(key.astype(np.uint16), kind="stable")
    b = max(1, (n - 1).bit_length())
    if n == 0 or (max(bound, 1) - 1) << b >= 1 << 32:
        return np.argsort(key, kind="stable")
    packed = key.astype(np.uint32)
    packed <<= b
    packed |= np.arange(n, dtype=np.uint32)
    packed.sort()
    packed &= (1 << b) - 1
    return packed.astype(np.int64)
