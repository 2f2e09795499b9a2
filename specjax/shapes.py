"""Shape buckets shared by the models, the engine and the stores (a leaf: imports nothing of specjax).

Device programs compile once per distinct shape, so sizes that follow request data are rounded up to buckets and
index arrays are padded to them."""

from __future__ import annotations

import numpy as np


def bucket(n: int, minimum: int = 16) -> int:
    """Round n up with at most 25% waste: multiples of a quarter of the enclosing power of two."""
    n = max(n, minimum)
    step = max(minimum, 1 << max(0, (n - 1).bit_length() - 3))
    return -(-n // step) * step


def padded(x, size: int, fill: int) -> np.ndarray:
    """Integers `x` as int32 [size], `fill` after them: index arrays padded to a bucket, so the device op that
    takes them compiles once per bucket."""
    out = np.full(size, fill, np.int32)
    out[: len(x)] = x
    return out
