"""SPEC's layer-aware speculation (paper IV-C): which chunks of layer i+1 to read while layer i computes.

The guess is the paper's: layer i's important set predicts layer i+1's. Reads are whole chunks, and a reordered
store lays each layer out in its own importance order, so the previous set's tokens can sit scattered over the
next layer's chunks; the guess is therefore chunk by chunk (`ranking`).

Two things measured online decide how much of that guess is read (`Speculator.chunks`), so that speculation pays
on a real disk and not only on a slow emulated one:

- **Each chunk's record** (`ChunkUsage`): how often this layer has needed the chunk, over the requests that matched
  it. A speculative read that goes unused costs the disk what a used one saves the layer (its read), so a chunk
  is read ahead only while it is at least as likely to be needed as not. The estimate is Laplace's, (used + 1) /
  (matched + 2): a chunk never seen is read, as is one the layer needed in half its requests or more; one the
  layer has needed in fewer is left to the demand read, as impress reads it. This is SPEC's importance-informed
  idea (the scores that reorder the store and rank the caches) carried into the prefetcher; it needs no setting.
- **The disk's budget**: as many of those chunks (best first, cached ones free) as the disk can deliver in the
  time before the layer's own reads are demanded, from its measured rate and that measured window, are read at
  speculative priority. The rest of the guess is read in the background: only when the disk would otherwise
  idle, and withdrawn unread if the layer's set does not need it (stores.scheduler).

And one thing decides whether to guess at all (`Speculator.pays`): a guess saves the layer at most the time that its
selected tokens' bytes from disk take at the disk's measured rate, and it costs the host the time to choose and issue
it, on the thread that issues reads, which competes with the request's own for the interpreter. All three are
measured (the bytes by every layer, guessed or not, the rate by the read scheduler, the host time by every guess),
so a disk that delivers a layer's selection faster than the host can ask for it ahead (a page-cached one, on few
cores) is left to the demand reads, and a slow one is read ahead.
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
import time

import numpy as np

from specjax.connector import K, V


class ChunkUsage:
    """(layer, chunk) -> how many requests matched the chunk and how many of them needed it at that layer. Kept per
    layer, chunk id -> count, so a layer's chunks are looked up in one pass (`likely`, on the I/O worker per layer)."""

    def __init__(self):
        self._matched: dict = collections.defaultdict(dict)  # layer -> {chunk: requests that matched it}
        self._needed: dict = collections.defaultdict(dict)  # layer -> {chunk: requests whose layer needed it}
        self._lock = threading.Lock()

    def record(self, layer: int, matched_chunks, needed_chunks) -> None:
        """One request's layer: it matched `matched_chunks` and its important set needed `needed_chunks`."""
        with self._lock:
            for table, chunks in ((self._matched[layer], matched_chunks), (self._needed[layer], needed_chunks)):
                for c in np.asarray(chunks, np.int64).tolist():
                    table[c] = table.get(c, 0) + 1

    def likely(self, layer: int, chunks) -> np.ndarray:
        """Per chunk: is it at least as likely to be needed as not, (needed + 1) / (matched + 2) >= 1/2?"""
        ids = np.asarray(chunks, np.int64).tolist()
        with self._lock:
            matched = np.fromiter(map(self._matched[layer].get, ids, itertools.repeat(0)), np.int64, len(ids))
            needed = np.fromiter(map(self._needed[layer].get, ids, itertools.repeat(0)), np.int64, len(ids))
        return 2 * (needed + 1) >= matched + 2

    def counts(self, layer: int, chunk: int) -> tuple[int, int]:
        """(matched, needed) of one chunk at one layer."""
        with self._lock:
            return self._matched[layer].get(chunk, 0), self._needed[layer].get(chunk, 0)

    def forget(self, chunk_ids) -> None:
        """The store deleted these chunks (ids are never reused in a process; this frees the memory)."""
        ids = set(chunk_ids)
        with self._lock:
            for tables in (self._matched, self._needed):
                for table in tables.values():
                    for c in ids.intersection(table):
                        del table[c]


def ranking(locate, layer: int, previous: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The chunks of `layer` the guess reads, best first, and how many of `previous` (layer - 1's important set)
    each holds: those holding most of the set, as many chunks as the set occupied in its own layer (the same I/O
    budget). Without reordering (or with one order for all layers) this is exactly the chunks of the set.
    `locate(layer, positions)`: where positions of the request's match lie (e.g. `LayerIO.locate`)."""
    budget = len(locate(layer - 1, previous).unique_chunks())
    chunks, counts = np.unique(locate(layer, previous).chunks, return_counts=True)
    best = np.argsort(-counts, kind="stable")[:budget]
    return chunks[best], counts[best]


class Speculator:
    """One engine's speculation: the chunks' records and the measured window, kept across its requests."""

    def __init__(self, store, cache=None, *, always: bool = False):
        """`always`: guess every layer, as the SPEC paper does (`pays` is then always yes)."""
        self.store, self.cache, self.always = store, cache, always
        self.usage = ChunkUsage()
        self.window_s: float | None = None  # measured: speculation issued -> the layer's K/V demanded
        self.selection_bytes: float | None = None  # measured: bytes of a layer's selected tokens read from disk
        self.cost_s: float | None = None  # measured: host time to choose and issue a layer's guess
        store.on_free(self.usage.forget)

    def chunks(self, locate, layer: int, previous: np.ndarray, kinds=(K, V)) -> tuple[np.ndarray, np.ndarray]:
        """The chunks of `layer` to read ahead, (now, background): the guess's chunks that their record says are
        likely needed, best first, split where the disk's budget for their `kinds` ends (`locate` as for
        `ranking`)."""
        ranked, _ = ranking(locate, layer, previous)
        ranked = ranked[self.usage.likely(layer, ranked)]
        now = self.within_budget(layer, ranked, self.budget_bytes(), kinds)
        return now, ranked[len(now):]

    def pays(self) -> bool:
        """Is a guess worth its host time? At best it saves the layer the wait for its selected tokens' bytes from
        disk (`selection_bytes` at the disk's measured rate); it costs the host `cost_s`. Yes until all three are
        measured; the bytes and the rate go on being measured while no guess is made, so a disk that slows down or
        caches that hold less bring the guesses back. Always yes for a speculator that guesses every layer (`always`:
        the paper's SPEC, `--always_speculate`)."""
        rate = self.store.scheduler.rate_bytes_per_s()
        if self.always or rate is None or self.selection_bytes is None or self.cost_s is None:
            return True
        return self.selection_bytes / rate > self.cost_s

    def observe_cost(self, seconds: float) -> None:
        """A guess took the host `seconds` to choose and issue."""
        self.cost_s = _average(self.cost_s, seconds)

    def observe_selection(self, nbytes: int) -> None:
        """A layer's selected tokens came to `nbytes` read from disk (read ahead or on demand; not cache hits)."""
        self.selection_bytes = _average(self.selection_bytes, float(nbytes))

    def budget_bytes(self) -> float:
        """Bytes speculation may add to the disk's queue now: its measured rate times the measured window between
        issuing a layer's speculation and demanding that layer's K/V, less what is queued already (inf until
        both have been measured)."""
        rate = self.store.scheduler.rate_bytes_per_s()
        if rate is None or self.window_s is None:
            return math.inf
        return rate * self.window_s - self.store.scheduler.queued_bytes()

    def within_budget(self, layer: int, ranked: np.ndarray, budget: float, kinds=(K, V)) -> np.ndarray:
        """The longest head of `ranked` chunks whose uncached bytes of `kinds` fit in `budget`."""
        lay = self.store.layout
        cost = np.zeros(len(ranked), np.int64)
        for kind in kinds:
            missing = (np.ones(len(ranked), bool) if self.cache is None
                       else ~self.cache.holds_many(layer, kind, ranked))
            cost += lay.chunk_nbytes(kind) * missing
        return ranked[: int(np.searchsorted(np.cumsum(cost), budget, side="right"))]

    def observe_window(self, opened: float) -> None:
        """A layer's K/V are demanded now, its speculation having been issued at `opened` (perf_counter): the
        time between is the window the disk had (moving average over layers and requests)."""
        self.window_s = _average(self.window_s, time.perf_counter() - opened)


def _average(old: float | None, new: float) -> float:
    """The speculator's measurements are moving averages over layers and requests; a new one weighs 0.2."""
    return new if old is None else 0.8 * old + 0.2 * new


def prefetch_report(issued: int = 0, ahead: int = 0, needed: int = 0, used: int = 0, guess_hits: int = 0,
                    guessed_layers: int = 0, unpaid_layers: int = 0) -> dict:
    """A request's speculative prefetch, in tokens, under the names results.json uses: `prefetch_issued` (guessed
    and requested ahead), `prefetch_ahead` (of those, read ahead: held by a cache or asked of the disk when their
    layer took its K/V; the rest was withdrawn unread or became a demand read), `prefetch_needed` (selected by the
    layers that had a guess), `prefetch_used` (read ahead and selected), `prefetch_guess_hits` (guessed and
    selected, read ahead or not). precision = used / ahead, recall = used / needed, and guess_recall = guess_hits /
    needed, how much of the sets the guess named (None without a guess). In layers: `prefetch_guessed_layers`, those
    whose next layer was guessed, and `prefetch_unpaid_layers`, those whose guess was not made because it would not
    have paid for its host time (`Speculator.pays`): their next layer read its set on demand."""
    some = bool(issued)
    return {"prefetch_issued": issued, "prefetch_ahead": ahead, "prefetch_needed": needed, "prefetch_used": used,
            "prefetch_guess_hits": guess_hits, "prefetch_guessed_layers": guessed_layers,
            "prefetch_unpaid_layers": unpaid_layers,
            "precision": used / max(ahead, 1) if some else None, "recall": used / max(needed, 1) if some else None,
            "guess_recall": guess_hits / max(needed, 1) if some else None}
