"""Sorted sets of integers (token positions, chunk ids, run numbers) made without sorting them (a leaf: imports
nothing of specjax).

numpy 2's `np.unique` hashes its input and then sorts what it found; a bitmap over the values' range does neither
and takes a fraction of its time on sets like the engine's (`benchmarks/results/cpu/host-exposed`). The engine makes
such sets on the request's path at every layer: a per-head layer's union, the chunks a take touches, the runs it
waits for.
"""

from __future__ import annotations

import numpy as np

DENSE = 8  # a bitmap where the values span at most this many times their count (plus PAGE)
PAGE = 4096


def distinct(ids, *, return_inverse: bool = False):
    """`np.unique(ids)` of integer `ids` (flattened): their distinct values ascending, in their dtype; with
    `return_inverse` also each id's index among them. A bitmap over [min, max] where that span is at most DENSE
    times their count plus PAGE, else `np.unique` itself."""
    flat = np.asarray(ids).ravel()
    if flat.dtype.kind not in "iu" or not flat.size:
        return np.unique(flat, return_inverse=return_inverse)
    lo, hi = int(flat.min()), int(flat.max())
    if hi - lo >= DENSE * flat.size + PAGE:
        return np.unique(flat, return_inverse=return_inverse)
    seen = np.zeros(hi - lo + 1, bool)
    shifted = flat - lo if lo else flat
    seen[shifted] = True
    out = (np.flatnonzero(seen) + lo).astype(flat.dtype, copy=False)
    if not return_inverse:
        return out
    return out, (np.cumsum(seen, dtype=np.intp) - 1)[shifted]


def consecutive_runs(chunks, max_chunks: int) -> list[tuple[int, int]]:
    """(first, count) runs of consecutive ids among `chunks`, each at most `max_chunks` long (numpy over the
    ids: no Python step per chunk)."""
    ids = distinct(np.asarray(chunks, np.int64))
    if not len(ids):
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    runs = []
    for first, end in zip(ids[np.r_[0, breaks]].tolist(), (ids[np.r_[breaks - 1, len(ids) - 1]] + 1).tolist()):
        for lo in range(first, end, max_chunks):
            runs.append((lo, min(max_chunks, end - lo)))
    return runs
