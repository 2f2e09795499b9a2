"""The prefetcher's books for one (layer, kind): the reads it holds, a slot per chunk they bring (`HeldReads`)."""

from __future__ import annotations

import collections
import itertools

import numpy as np

from specjax.idsets import distinct


class HeldReads:
    """The reads held for one (layer, kind): each chunk a read brings has a slot (a run's chunks consecutive ones),
    with its chunk id, its run (index into `runs`), how many tickets and takes hold it (a slot is held while that is
    above zero), whether it is still speculative (issued ahead of need: yields to demand reads at the disk) and
    whether a take used it (and offered it to the caches). A chunk nobody holds is forgotten: a later need reads it
    anew into a new slot. Once no slot is held the table starts over, so it spans what one layer has in flight."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.runs: list = []  # Run, or None once none of its slots is held (its buffer is then free to go)
        self.slot_of: dict = {}  # chunk id -> its held slot
        self.chunk = np.zeros(0, np.int64)
        self.run_of = np.zeros(0, np.int64)
        self.holders = np.zeros(0, np.int32)
        self.speculative = np.zeros(0, bool)
        self.taken = np.zeros(0, bool)

    def find(self, chunks: np.ndarray) -> np.ndarray:
        """The held slot of each chunk, -1 where none."""
        get = self.slot_of.get
        return np.fromiter(map(get, chunks.tolist(), itertools.repeat(-1)), np.int64, len(chunks))

    def add(self, runs: list, speculative: bool) -> np.ndarray:
        """Slots for the chunks of `runs` (one holder each); returns them."""
        first = np.array([r.first_chunk for r in runs], np.int64)
        count = np.array([r.n_chunks for r in runs], np.int64)
        total = int(count.sum())
        base, run_base = len(self.chunk), len(self.runs)
        chunks = np.repeat(first - np.cumsum(count) + count, count) + np.arange(total)  # each new slot's chunk
        self.runs += runs
        self.chunk = np.concatenate([self.chunk, chunks])
        self.run_of = np.concatenate([self.run_of, np.repeat(np.arange(run_base, run_base + len(runs)), count)])
        self.holders = np.concatenate([self.holders, np.ones(total, np.int32)])
        self.speculative = np.concatenate([self.speculative, np.full(total, speculative)])
        self.taken = np.concatenate([self.taken, np.zeros(total, bool)])
        slots = np.arange(base, base + total)
        self.slot_of.update(zip(chunks.tolist(), slots.tolist()))
        return slots

    def forget(self, slots: np.ndarray) -> None:
        """Nobody holds `slots` any more (their holder counts are down to zero)."""
        collections.deque(map(self.slot_of.pop, self.chunk[slots].tolist()), maxlen=0)
        if not self.slot_of:
            self.reset()
            return
        for r in distinct(self.run_of[slots]).tolist():
            if not (self.holders[self.run_of == r] > 0).any():
                self.runs[r] = None

    def runs_of(self, slots: np.ndarray) -> list:
        """The distinct runs holding `slots`, with the slots of each: [(run index, slots)]."""
        run_of = self.run_of[slots]
        return [(r, slots[run_of == r]) for r in distinct(run_of).tolist()]
