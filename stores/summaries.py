"""Per-chunk key summaries (Quest): the element-wise minimum and maximum of each chunk's keys, per KV head.

A query's score against any key of a chunk is at most sum_d max(q_d * min_d, q_d * max_d), so the summaries rank
chunks before any key is read. They live in host memory (the host tier), 2 / chunk_tokens of the keys' bytes:
computed from the keys whenever this handle writes a chunk (inserts and reorder repacks both write through
`SegmentWriter`), and from a verified read of the chunk's keys when it has not (another process's insert, a store
opened anew; those reads count as disk bytes). A summary is filed under its chunk's per-head checksums, so a chunk
id reused after an eviction never finds the summary of what it held before. The last chunk of a segment is padded
with zero rows, which widen its bounds but never make them wrong.
"""

from __future__ import annotations

import threading

import numpy as np


def summarise(keys: np.ndarray) -> np.ndarray:
    """Keys of one chunk `[heads, chunk_tokens, head_dim]` -> its summary `[heads, 2, head_dim]` (min, max)."""
    return np.stack([keys.min(axis=1), keys.max(axis=1)], axis=1)


class KeySummaries:
    """Summaries by (layer, chunk id, the chunk's per-head checksums); thread-safe."""

    def __init__(self):
        self._by_chunk: dict[tuple, np.ndarray] = {}
        self._lock = threading.Lock()

    def put(self, layer: int, chunk: int, checksums: tuple, keys: np.ndarray) -> None:
        """File the summary of `keys` (one chunk's, as written or read)."""
        summary = summarise(np.asarray(keys))
        with self._lock:
            self._by_chunk[(layer, chunk, checksums)] = summary

    def get(self, layer: int, chunk: int, checksums: tuple) -> np.ndarray | None:
        with self._lock:
            return self._by_chunk.get((layer, chunk, checksums))

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_chunk)
