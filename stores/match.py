"""`Match`: the longest stored prefix of a request, as the radix-tree path it takes through the store's segments,
pinned by the `StoreIndex` that made it until it is closed."""

from __future__ import annotations

import weakref
from typing import Callable

import numpy as np

from specjax.stores.radix import PathStep


class Match:
    """The longest stored prefix of a request, pinned (readable, not evicted) until `close()`.

    `release(generation, node_ids)` unpins it; it runs once, at `close()` or when the match is collected."""

    def __init__(self, release: Callable[[int, tuple], None], steps: list[PathStep], tokens: np.ndarray,
                 generation: int):
        self.steps = steps
        self.length = sum(s.length for s in steps)
        self.tokens = tokens[:self.length]
        self.generation = generation
        self._prefix_starts = np.array([s.prefix_start for s in steps], np.int64)
        self._release = weakref.finalize(self, release, generation, tuple(s.node_id for s in steps))

    def node_ids(self) -> list[int]:
        return [s.node_id for s in self.steps]

    def step_of(self, positions: np.ndarray) -> np.ndarray:
        """The index into `steps` of the step holding each matched position."""
        return np.searchsorted(self._prefix_starts, positions, side="right") - 1

    def close(self) -> None:
        self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
