"""Exclusive device and host chunk caches with byte budgets and pluggable scores.

The device tier decides which chunks are on the device; its memory is a page pool (stores.pool) that mirrors its
decisions, and it keeps each chunk's host copy as the source of a later demotion (a demotion then copies nothing
back). The host tier keeps its chunks in the slots of a host page array (stores.pool.HostPages), so that a take
gathers all its host hits' rows in one step. Every chunk also lives on disk, so eviction never writes. Each tier is a lazy min-heap by score: a chunk enters
or is promoted into a tier only if it outscores the chunks it would push out (SPEC IV-D, ContiguousKV 4.4).
Policies: `lru` (recency), `lfu` (frequency), `spec_score` (frequency x moving-average fraction of important
tokens in the chunk) and `attention_score` (cumulative importance x frequency); ties go to the more recent.

Placement is write-behind: a request's uses of chunks (`lookup_many`) and what its takes read from disk
(`admit_later`) are recorded, and applied by `settle` once its first token is out (`Prefetcher.close`), in the order
they happened: uses re-score their chunks and promote host hits, reads are placed by their scores. Nothing on the path
to the first token updates a score, runs the tiers' heaps, copies a chunk or writes a device page (per chunk used or
read, at a 7B model's KV shape 3,640 a request for as_full). Until then a chunk read is served from its read buffer
to any later take of the same request (`holds`, `lookup_many`). One consequence: a request that scans more than the
tiers hold no longer evicts, early in its scan, what it is about to use later (LRU on a cyclic scan), since an
admission is weighed against the uses of the whole request.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import operator
import threading

import numpy as np

from specjax.stores.metrics import StoreMetrics

POLICIES = ("lru", "lfu", "spec_score", "attention_score")
DEVICE, HOST = "device", "host"
_USE, _READ = "use", "read"  # what a request did, applied at `TieredCache.settle`


@dataclasses.dataclass
class ChunkStats:
    freq: int = 0
    last: int = 0
    important_fraction: float | None = None  # moving average over accesses
    importance: float = 0.0                  # cumulative attention importance


def make_score(policy: str, ema: float = 0.5):
    """The policy's score of a chunk's stats; larger stays cached. Ties are broken by recency."""
    if policy == "lru":
        return lambda s: (float(s.last), 0)
    if policy == "lfu":
        return lambda s: (float(s.freq), s.last)
    if policy == "spec_score":
        return lambda s: (s.freq * (s.important_fraction or 0.0), s.last)
    if policy == "attention_score":
        return lambda s: (s.importance * s.freq, s.last)
    raise ValueError(f"unknown cache policy {policy!r}; choose one of {', '.join(POLICIES)}")


def _or(value, default):
    return default if value is None else value


def chunk_keys(layer: int, kind: int, chunks) -> list:
    """The cache keys (layer, kind, chunk id) of `chunks`, built without a Python step per chunk."""
    return list(zip(itertools.repeat(layer), itertools.repeat(kind), np.asarray(chunks, np.int64).tolist()))


class _Tier:
    """One budgeted store of arrays with a lazy min-heap of (score, seq, key).

    A re-scored key is pushed again; only its newest entry (`_latest[key]`) is live, and the heap is rebuilt
    from the live entries once stale ones outnumber them, so a push costs O(log n) amortised.
    """

    def __init__(self, name: str, budget_bytes: int):
        self.name, self.budget_bytes = name, int(budget_bytes)
        self.listener = None  # told of every put and pop (the device tier's page pool)
        self.items: dict = {}
        self.used_bytes = 0
        self._heap: list = []
        self._latest: dict = {}  # key -> seq of its live heap entry
        self._seq = itertools.count()

    def _live(self, entry) -> bool:
        return self._latest.get(entry[2]) == entry[1]

    def push(self, key, score) -> None:
        seq = next(self._seq)
        self._latest[key] = seq
        heapq.heappush(self._heap, (score, seq, key))
        if len(self._heap) > 2 * len(self.items) + 64:
            self._heap = [e for e in self._heap if self._live(e)]
            heapq.heapify(self._heap)

    def put(self, key, array, score) -> None:
        if self.listener is not None:  # the host tier's pages keep a copy, and the tier its view
            array = _or(self.listener.placed(key, array), array)
        self.items[key] = array
        self.used_bytes += array.nbytes
        self.push(key, score)

    def pop(self, key):
        """The chunk `key` leaves the tier; returned as an array of its own (a host page's slot is free again)."""
        array = self.items.pop(key)
        self._latest.pop(key, None)
        self.used_bytes -= array.nbytes
        if self.listener is not None:
            if self.listener.copies_out:
                array = np.array(array)
            self.listener.removed(key)
        return array

    def victims_for(self, nbytes: int, score, current_score) -> list | None:
        """Lowest-scored keys to drop so `nbytes` fit, if each scores below `score`; None if they do not."""
        if nbytes > self.budget_bytes:
            return None
        free, victims, popped = self.budget_bytes - self.used_bytes, [], []
        while free < nbytes:
            while self._heap:
                entry = heapq.heappop(self._heap)
                key = entry[2]
                if self._live(entry) and entry[0] == current_score(key) and key not in victims:
                    popped.append(entry)
                    break
            else:
                break
            if entry[0] >= score:
                break
            victims.append(key)
            free += self.items[key].nbytes
        for entry in popped:
            heapq.heappush(self._heap, entry)
        return victims if free >= nbytes else None


class TieredCache:
    """Device + host chunk caches, exclusive of each other; keys are (layer, kind, chunk_id)."""

    def __init__(self, gpu_cache_bytes: int, cpu_cache_bytes: int, policy: str = "lru", *,
                 metrics: StoreMetrics | None = None, ema: float = 0.5, record_events: bool = False):
        """`gpu_cache_bytes` / `cpu_cache_bytes`: the device / host tier's budget in bytes."""
        self.policy = policy
        self._score_fn = make_score(policy)
        self.ema = ema
        self.metrics = metrics if metrics is not None else StoreMetrics()
        self.tiers = {DEVICE: _Tier(DEVICE, gpu_cache_bytes), HOST: _Tier(HOST, cpu_cache_bytes)}
        self.stats: dict = collections.defaultdict(ChunkStats)  # kept after eviction, as in ContiguousKV
        self._clock = itertools.count(1)
        self._lock = threading.RLock()
        self.events: list | None = [] if record_events else None
        self._read: dict = {}  # key -> chunk read from disk, placed at `settle` (a view of its read buffer)
        self._read_bytes = 0
        # what `settle` applies, in order: (_USE, keys, their uses) per lookup, (_READ, keys, chunks) per read
        self._later: list = []
        self.host_pages = None  # the host tier's page arrays, once attached

    def attach(self, pool, host_pages=None) -> None:
        """Mirror the device tier in `pool` (stores.pool.DevicePool) and the host tier in `host_pages`
        (stores.pool.HostPages, optional): each told of every chunk its tier places and drops."""
        if self.tiers[DEVICE].items or (host_pages is not None and self.tiers[HOST].items):
            raise ValueError("attach the page pools before the tiers hold chunks")
        self.tiers[DEVICE].listener = pool
        if host_pages is not None:
            self.tiers[HOST].listener = host_pages
        self.host_pages = host_pages

    # -- accounting ----------------------------------------------------------------------------

    @property
    def gpu_cache_bytes(self) -> int:
        """The device tier's budget."""
        return self.tiers[DEVICE].budget_bytes

    @property
    def cpu_cache_bytes(self) -> int:
        """The host tier's budget."""
        return self.tiers[HOST].budget_bytes

    @property
    def device_bytes(self) -> int:
        """The bytes the device tier holds now."""
        return self.tiers[DEVICE].used_bytes

    @property
    def host_bytes(self) -> int:
        """The bytes the host tier holds now."""
        return self.tiers[HOST].used_bytes

    def where(self, key) -> str | None:
        with self._lock:
            for name, tier in self.tiers.items():
                if key in tier.items:
                    return name
        return None

    def holds(self, key) -> bool:
        """Is `key` in memory: in a tier, or read by this request and waiting for `settle`? (Such a chunk needs no
        disk read.)"""
        with self._lock:
            return key in self._read or self.where(key) is not None

    def holds_many(self, layer: int, kind: int, chunks) -> np.ndarray:
        """`holds` per chunk of (layer, kind), under one lock (bool per chunk)."""
        return self._in_memory(chunk_keys(layer, kind, chunks), pending=True)

    def held(self, keys) -> np.ndarray:
        """Which of `keys` a tier holds (bool per key), under one lock: what a request would not read from disk."""
        return self._in_memory(keys, pending=False)

    def _in_memory(self, keys, *, pending: bool) -> np.ndarray:
        """Per key: in a tier, or (`pending`) read by this request and waiting for `settle`."""
        with self._lock:
            device, host = self.tiers[DEVICE].items, self.tiers[HOST].items
            read = self._read if pending else {}
            return np.fromiter((key in read or key in device or key in host for key in keys), bool, len(keys))

    def score(self, key):
        return self._score_fn(self.stats[key])

    def _event(self, *event) -> None:
        if self.events is not None:
            self.events.append(event)

    # -- scores --------------------------------------------------------------------------------

    def _update(self, key, n_needed: int | None, chunk_tokens: int | None, important_fraction: float | None,
                importance: float | None) -> None:
        s = self.stats[key]
        s.freq += 1
        s.last = next(self._clock)
        if important_fraction is None and n_needed is not None and chunk_tokens:
            important_fraction = n_needed / chunk_tokens
        self._record_importance(key, important_fraction, importance)

    def _record_importance(self, key, important_fraction: float | None, importance: float | None) -> None:
        """Fold one observation into the chunk's moving-average fraction and cumulative importance; re-rank it."""
        s = self.stats[key]
        if important_fraction is not None:
            s.important_fraction = (important_fraction if s.important_fraction is None
                                    else self.ema * important_fraction + (1 - self.ema) * s.important_fraction)
        if importance is not None:
            s.importance += float(importance)
        tier = self.where(key)
        if tier is not None:
            self.tiers[tier].push(key, self.score(key))

    def feedback(self, key, important_fraction: float | None = None, importance: float | None = None) -> None:
        """Importance feedback without an access (e.g. after the engine scored a chunk it already used)."""
        with self._lock:
            self._record_importance(key, important_fraction, importance)

    # -- placement -----------------------------------------------------------------------------

    def _try_place(self, tier_name: str, key, array) -> bool:
        """Put `key` in a tier if it fits or outscores what it would push out; demote device victims."""
        tier, score = self.tiers[tier_name], self.score(key)
        victims = tier.victims_for(array.nbytes, score, self.score)
        if victims is None:
            return False
        evicted = [(v, tier.pop(v)) for v in victims]
        tier.put(key, np.asarray(array), score)
        self._event("place", key, tier_name)
        for victim, victim_array in evicted:
            if tier_name == DEVICE:
                self._event("demote", victim, DEVICE)
                if not self._try_place(HOST, victim, victim_array):
                    self._event("evict", victim, HOST)
            else:
                self._event("evict", victim, HOST)
        return True

    def admit(self, key, host_array: np.ndarray) -> None:
        """Place a chunk just read from disk by its score: on the device, in host memory or neither. (Serving its
        vectors is the prefetcher's: `Prefetcher.take` assembles every take's vectors in one place.)"""
        with self._lock:
            if self.where(key) is None:
                if not self._try_place(DEVICE, key, host_array):
                    self._try_place(HOST, key, host_array)

    def admit_later(self, keys, arrays) -> None:
        """Chunks just read from disk (`arrays[i]` of `keys[i]`, views of their read buffer, which they keep until
        then), placed by `settle`. Past what both tiers could hold (the bound on read buffers kept for it), a chunk
        is not offered. One record per call: nothing per chunk but a membership test and a dict entry."""
        limit = sum(t.budget_bytes for t in self.tiers.values())
        with self._lock:
            known = self._in_memory(keys, pending=True)
            kept_keys, kept = [], []
            for key, array, seen in zip(keys, arrays, known.tolist()):
                if seen or key in self._read or self._read_bytes + array.nbytes > limit:
                    continue
                self._read[key] = array
                self._read_bytes += array.nbytes
                kept_keys.append(key)
                kept.append(array)
            if kept_keys:
                self._later.append((_READ, kept_keys, kept))

    def settle(self) -> None:
        """Apply what the request did, in the order it happened: each use re-scores its chunk (and a host hit is
        promoted to the device if it now outscores the device minimum), each chunk read is placed by its score
        (copied out of its read buffer)."""
        with self._lock:
            later, read, self._later, self._read, self._read_bytes = self._later, self._read, [], {}, 0
            host = self.tiers[HOST]
            for event, keys, detail in later:
                if event is _READ:
                    for key, array in zip(keys, detail):
                        if key in read:  # not invalidated since
                            self.admit(key, np.array(array))
                    continue
                n_needed, chunk_tokens, important_fraction, importance, host_hits = detail
                for i, key in enumerate(keys):
                    self._update(key, n_needed[i], chunk_tokens, important_fraction,
                                 None if importance is None else importance[i])
                    if host_hits[i] and key in host.items:
                        array = host.pop(key)
                        if not self._try_place(DEVICE, key, array):
                            host.put(key, array, self.score(key))

    def lookup(self, key, n_needed: int | None = None, *, chunk_tokens: int | None = None,
               important_fraction: float | None = None, importance: float | None = None):
        """A use of `n_needed` of a chunk's tokens: the whole cached chunk (its host copy; on a device hit the pool
        holds it on the device), None on a miss (`lookup_many` for one key)."""
        return self.lookup_many([key], [n_needed], chunk_tokens=chunk_tokens, important_fraction=important_fraction,
                                importance=None if importance is None else [importance])[0]

    def lookup_many(self, keys, n_needed, *, chunk_tokens: int | None = None,
                    important_fraction: float | None = None, importance=None) -> list:
        """Uses of chunks (`n_needed[i]` of `keys[i]`'s tokens, `importance[i]` if given), under one lock: each the
        whole cached chunk or None on a miss; a chunk this request read is served from its read buffer (a host
        hit). Hits are counted per tier now; the uses re-score their chunks at `settle` (one record per call: the
        path to the first token does nothing per chunk but three dict lookups)."""
        keys = list(keys)
        with self._lock:
            on_device = list(map(self.tiers[DEVICE].items.get, keys))
            on_host = list(map(self.tiers[HOST].items.get, keys))
            read = self._read
            out = [d if d is not None else h if h is not None else read.get(key)
                   for key, d, h in zip(keys, on_device, on_host)]
            device_hits = len(keys) - sum(map(operator.is_, on_device, itertools.repeat(None)))
            misses = sum(map(operator.is_, out, itertools.repeat(None)))
            self._later.append((_USE, keys, (list(n_needed), chunk_tokens, important_fraction,
                                             None if importance is None else list(importance),
                                             [h is not None for h in on_host])))
            self.metrics.add(device_hits=device_hits, host_hits=len(keys) - device_hits - misses, misses=misses)
        return out

    def invalidate(self, chunk_ids) -> None:
        """Forget deleted chunks (their ids are never reused within a process, this only frees memory)."""
        ids = set(chunk_ids)
        with self._lock:
            for key in [k for k in self._read if k[2] in ids]:
                self._read_bytes -= self._read.pop(key).nbytes
            self._later = [_without(e, ids) for e in self._later]
            for tier in self.tiers.values():
                for key in [k for k in tier.items if k[2] in ids]:
                    tier.pop(key)
            for key in [k for k in self.stats if k[2] in ids]:
                del self.stats[key]


def _without(event: tuple, ids: set) -> tuple:
    """A recorded `_USE` or `_READ` (`TieredCache._later`) without the keys of chunks `ids`."""
    kind, keys, detail = event
    keep = [i for i, key in enumerate(keys) if key[2] not in ids]
    if len(keep) == len(keys):
        return event
    pick = lambda values: None if values is None else [values[i] for i in keep]  # noqa: E731
    if kind is _READ:
        return kind, pick(keys), pick(detail)
    n_needed, chunk_tokens, important_fraction, importance, host_hits = detail
    return kind, pick(keys), (pick(n_needed), chunk_tokens, important_fraction, pick(importance), pick(host_hits))
