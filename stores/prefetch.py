"""Host-side asynchronous prefetcher: `request` starts chunk reads and returns at once, `take` waits only for
what is still missing and hands back device arrays in original token order.

Reads go to the store as runs of adjacent chunks (one disk request each) through the disk's read scheduler, and the
prefetcher keeps its books per run too (`_Held`: numpy per chunk of a run, no Python object or step per chunk).
A take reads its tokens out of the device page pool (stores.pool) through a block table: device-cache hits from
their pages, the rest (just read, host-cache hits) from one host buffer that crosses in one copy. That is two or
three device steps per take, however many chunks it touches.

The caches learn what a request used and read when it is closed (`close`, once its first token is out: placement is
write-behind, `stores.caches`); close the prefetcher after every request.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
import time

import jax
import numpy as np

from specjax.shapes import padded
from specjax.stores.caches import DEVICE, TieredCache
from specjax.stores.pool import DevicePool
from specjax.stores.store import KVStore, Locations, Match, Run


@dataclasses.dataclass(eq=False)
class _Held:
    """A run read (`stores.reads.Run`: chunks `run.first_chunk ..`) the prefetcher holds, with per chunk of it: how many
    tickets and takes hold it, whether it is still speculative (issued ahead of need, yields to demand reads at the
    disk), whether a take used it (and offered it to the caches), whether it is still held at all (a chunk nobody
    holds is forgotten: a later need reads it anew)."""
    run: Run
    holders: np.ndarray
    speculative: np.ndarray
    taken: np.ndarray
    live: np.ndarray

    @classmethod
    def new(cls, run: Run, speculative: bool) -> "_Held":
        n = run.n_chunks
        return cls(run, np.ones(n, np.int32), np.full(n, speculative), np.zeros(n, bool), np.ones(n, bool))


class _Table:
    """The runs held for one (layer, kind), and which of them holds a chunk live: a few numpy steps per run, none per
    chunk. (A chunk is held live by at most one run: one found is never read again. A run's ids may overlap another's
    where a chunk was let go and read anew.)"""

    def __init__(self):
        self.runs: list[_Held] = []

    def find(self, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per chunk: the index of the run in `runs` holding it live (-1: none) and its index in that run."""
        at, j = np.full(len(chunks), -1, np.int64), np.zeros(len(chunks), np.int64)
        for i, held in enumerate(self.runs):
            first = held.run.first_chunk
            inside = np.flatnonzero((chunks >= first) & (chunks < first + held.run.n_chunks))
            if len(inside):
                inside = inside[held.live[chunks[inside] - first]]
                at[inside], j[inside] = i, chunks[inside] - first
        return at, j

    def add(self, held: _Held) -> None:
        self.runs.append(held)

    def drop(self, held: _Held) -> None:
        self.runs.remove(held)


@dataclasses.dataclass
class Ticket:
    layer: int
    kind: int
    holds: list  # (_Held, indices of the chunks it holds in that run)
    speculative: bool
    released: bool = False

    @property
    def keys(self) -> list:
        """(layer, kind, chunk) of every chunk the ticket holds."""
        return [(self.layer, self.kind, held.run.first_chunk + int(j)) for held, idx in self.holds for j in idx]


@dataclasses.dataclass
class Taken:
    """`array` `[heads, n, head_dim]` on the device in the requested order; `ok[i]` False where a chunk was
    bad (zeros there: recompute those tokens); `waited_ms` is the time `take` blocked on I/O."""
    array: jax.Array
    ok: np.ndarray
    waited_ms: float
    chunks_from_disk: int


class Prefetcher:
    """Moves chunks disk -> host -> device ahead of use, within `max_buffer_bytes` of staged speculative reads."""

    def __init__(self, store: KVStore, cache: TieredCache | None = None, *, max_buffer_bytes: int = 256 << 20,
                 pcie_bandwidth: float | None = None):
        """`pcie_bandwidth`: bytes/s of an emulated host->device link (None: not throttled)."""
        self.store, self.cache = store, cache
        self.max_buffer_bytes = max_buffer_bytes
        self._tables: dict = {}  # (layer, kind) -> _Table of the runs held
        self._buffered = 0
        self._tickets: dict = {}   # (layer, kind) -> open tickets
        self._lock = threading.Lock()
        device_bytes = cache.tiers[DEVICE].budget_bytes if cache is not None else 0
        self.pool = DevicePool(store.layout, device_bytes, metrics=store.metrics, pcie_bandwidth=pcie_bandwidth)
        if cache is not None:
            cache.attach(self.pool)
            store.on_free(cache.invalidate)

    @property
    def buffered_bytes(self) -> int:
        return self._buffered

    def _table(self, layer: int, kind: int) -> _Table:
        table = self._tables.get((layer, kind))
        if table is None:
            table = self._tables[(layer, kind)] = _Table()
        return table

    def _hold(self, layer: int, kind: int, chunks, demand: bool, background: bool = False) -> list:
        """Hold the reads of (layer, kind) for `chunks` (distinct ids), issuing those not in flight as coalesced
        reads (speculative ones `background` at the disk if asked); speculative reads respect the buffer bound, and
        a demand for a speculative read in flight expedites it. Returns the holds: (_Held, chunk indices in it)."""
        chunks = np.asarray(chunks, np.int64)
        table = self._table(layer, kind)
        at, j = table.find(chunks)
        holds = []
        for i in np.unique(at[at >= 0]).tolist():
            held, idx = table.runs[i], j[at == i]
            held.holders[idx] += 1
            if demand and held.speculative[idx].any():
                held.speculative[idx] = False
                self.store.expedite(held.run)
            holds.append((held, idx))
        new = chunks[at < 0]
        nbytes = self.store.layout.chunk_nbytes(kind)
        if not demand:  # within the bound on staged speculative reads
            new = new[:max(0, (self.max_buffer_bytes - self._buffered) // nbytes)]
        if len(new):
            for run in self.store.read_runs(layer, kind, new, speculative=not demand, background=background):
                held = _Held.new(run, speculative=not demand)
                table.add(held)
                self._buffered += nbytes * run.n_chunks
                holds.append((held, np.arange(run.n_chunks)))
        return holds

    def _release(self, layer: int, kind: int, holds) -> None:
        """Let go of holds (`_hold`); the chunks nobody holds any more are forgotten: a speculative read nobody
        needed is withdrawn (one the disk has not been asked for yet is never read); any other read completes and
        is offered to the caches if no take used it. Per run, not per chunk."""
        nbytes = self.store.layout.chunk_nbytes(kind)
        for held, idx in holds:
            held.holders[idx] -= 1
            gone = idx[(held.holders[idx] <= 0) & held.live[idx]]
            if not len(gone):
                continue
            held.live[gone] = False
            self._buffered -= nbytes * len(gone)
            spec = int(held.speculative[gone].sum())
            if spec:
                self.store.withdraw(held.run, spec)
            unused = gone[~held.taken[gone]]
            if len(unused) and self.caching:
                held.run.verified.add_done_callback(functools.partial(
                    self._keep_unused, layer, kind, held.run.first_chunk, (held.run.first_chunk + unused).tolist()))
            if not held.live.any():
                self._table(layer, kind).drop(held)

    def _keep_unused(self, layer: int, kind: int, first: int, chunks: list, verified) -> None:
        """Reads nobody took (a speculation the layer's real set superseded), chunks `chunks` of the run read from
        chunk `first` on, were paid for: the caches place them by their scores like any chunk read from disk (at the
        request's end), so they evict only what their policy values less. One callback per run read, not per
        chunk."""
        if verified.cancelled():  # withdrawn before it was read
            return
        arrays, ok = verified.result()
        kept = [c for c in chunks if ok[c - first]]
        if kept:  # copies: not views that keep the whole run's buffer alive until the next `settle`
            self.cache.admit_later([(layer, kind, c) for c in kept], [arrays[c - first].copy() for c in kept])

    def request(self, match: Match, layer: int, kind: int, positions=None, *, chunks=None,
                speculative: bool = False, background=()) -> Ticket:
        """Start reading the chunks of `positions` (or the chunk ids `chunks`, already located) not already cached;
        returns immediately. With `speculative`, the chunk ids `background` are read too, but only while the disk
        has nothing else to do (stores.scheduler). A new request for the same (layer, kind) supersedes earlier
        speculative ones (their unshared reads are dropped)."""
        if len(background) and not speculative:
            raise ValueError("background reads are speculative")
        if chunks is None:
            chunks = self.store.locate(match, positions, layer).unique_chunks()
        if self.caching:
            chunks = np.asarray(chunks, np.int64)
            chunks = chunks[~self.cache.holds_many(layer, kind, chunks)]
            if len(background):
                background = np.asarray(background, np.int64)
                background = background[~self.cache.holds_many(layer, kind, background)]
        with self._lock:
            holds = self._hold(layer, kind, chunks, demand=not speculative)
            if len(background):
                holds += self._hold(layer, kind, background, demand=False, background=True)
            ticket = Ticket(layer, kind, holds, speculative)
            open_tickets = self._tickets.setdefault((layer, kind), [])
            for old in [t for t in open_tickets if t.speculative]:
                self._cancel_locked(old)
            open_tickets.append(ticket)
        return ticket

    def _cancel_locked(self, ticket: Ticket) -> None:
        if not ticket.released:
            ticket.released = True
            self._release(ticket.layer, ticket.kind, ticket.holds)
            tickets = self._tickets.get((ticket.layer, ticket.kind), [])
            if ticket in tickets:
                tickets.remove(ticket)

    def cancel(self, ticket: Ticket) -> None:
        with self._lock:
            self._cancel_locked(ticket)

    def ahead(self, layer: int, kind: int, chunks) -> np.ndarray:
        """Per chunk of (layer, kind): is it on its way already, held by a cache tier or its read asked of the disk?
        (False: a take now would have to read it, or expedite a read still waiting in the disk's queue.)"""
        chunks = np.asarray(chunks, np.int64)
        out = np.zeros(len(chunks), bool) if self.cache is None else self.cache.holds_many(layer, kind, chunks)
        with self._lock:
            table = self._table(layer, kind)
            at, _ = table.find(chunks)
            todo = ~out & (at >= 0)
            for i in np.unique(at[todo]).tolist():
                out[todo & (at == i)] = not self.store.waiting(table.runs[i].run)
        return out

    def wait(self, tickets, timeout: float | None = None) -> bool:
        """Block until every read the tickets started has landed (at most `timeout` seconds); True if they have.

        For the layers that must arrive before computing (ContiguousKV's sub-period), and for a caller that may
        have to give up (Cake's loader, once the device has computed the chunk) and so waits in short slices."""
        with self._lock:
            futures = {id(held.run): held.run.verified for t in tickets for held, _ in t.holds}
        _, pending = concurrent.futures.wait(list(futures.values()), timeout=timeout)
        return not pending

    def take(self, match: Match, layer: int, kind: int, positions, *, importance=None,
             pad_to: int | None = None, loc: Locations | None = None) -> Taken:
        """Vectors of `positions` on the device; waits only for reads still in flight.

        `importance` (per position, optional) feeds the `attention_score` policy; the important fraction of
        each chunk for `spec_score` is taken as the share of its tokens requested here. `pad_to` >= the number
        of positions gives an array of that many tokens (zeros after the requested ones), so a caller that
        buckets its sizes compiles each device op once per bucket. `loc`: the positions' locations at `layer`,
        if the caller has them.

        The host work is per disk read, not per chunk: the take waits for each run read (its chunks verified on the
        I/O thread that landed it) and copies the rows it needs out of it in one indexing step; with both cache
        tiers off no chunk is looked up or offered to them.
        """
        positions = np.asarray(positions, np.int64)
        size = len(positions) if pad_to is None else pad_to
        if size < len(positions):
            raise ValueError(f"pad_to={pad_to} is smaller than the {len(positions)} positions asked for")
        if loc is None:
            loc = self.store.locate(match, positions, layer)
        chunks, inverse = loc.chunk_index
        lay = self.store.layout
        self.store.metrics.add(used_token_bytes=len(positions) * lay.token_nbytes(kind))
        cached = {}  # chunk index -> cached chunk array
        if self.caching:
            imp = None if importance is None else np.asarray(importance, np.float64)
            counts = np.bincount(inverse, minlength=len(chunks))
            importance_of = None if imp is None else np.bincount(inverse, weights=imp, minlength=len(chunks))
            found = self.cache.lookup_many([(layer, kind, int(c)) for c in chunks], counts.tolist(),
                                           chunk_tokens=lay.chunk_tokens, importance=importance_of)
            cached = {i: array for i, array in enumerate(found) if array is not None}
        else:
            self.store.metrics.add(misses=len(chunks))
        missing = chunks
        if cached:
            missing = np.delete(chunks, np.fromiter(cached, np.int64, len(cached)))
        with self._lock:
            demand = self._hold(layer, kind, missing, demand=True)
            runs = {}  # the run reads holding the missing chunks
            for held, idx in demand:
                held.taken[idx] = True
                runs[id(held.run)] = held.run
        start = time.perf_counter()
        concurrent.futures.wait([run.verified for run in runs.values()])
        waited_ms = (time.perf_counter() - start) * 1e3
        try:
            array, ok = self._assemble(layer, kind, chunks, inverse, loc.offsets, size, cached, list(runs.values()))
        finally:
            with self._lock:
                self._release(layer, kind, demand)
                for ticket in list(self._tickets.get((layer, kind), [])):
                    self._cancel_locked(ticket)
        return Taken(array, ok, waited_ms, len(missing))

    @property
    def caching(self) -> bool:
        """Does either cache tier have room? (With both off, takes skip every per-chunk cache step.)"""
        return self.cache is not None and any(t.budget_bytes > 0 for t in self.cache.tiers.values())

    def _assemble(self, layer: int, kind: int, chunks: np.ndarray, inverse: np.ndarray, offsets: np.ndarray,
                  size: int, cached: dict, runs) -> tuple[jax.Array, np.ndarray]:
        """The take's `[heads, size, d]` on the device and its `ok` rows.

        Rows of cache hits come from their device pages (block table) where the device tier keeps them, else from a
        host buffer. Rows read from disk: when every run landed in one segment's landing buffer of whole chunks, no
        hit needs the host buffer and the take needs at least half of the buffer's tokens (whole pages then cost at
        most twice the link bytes of the needed vectors; a layer's certain reads need all of them), that buffer
        crosses as it is and the device gathers those rows; else they are copied into the host buffer too (per run
        read one indexing step), which crosses in one copy. With the caches on, every chunk read is offered to them,
        placed once the request's first token is out (`close`)."""
        lay = self.store.layout
        c = lay.chunk_tokens
        n = len(inverse)
        ok = np.ones(n, bool)
        slots = np.full(size, -1, np.int64)  # the take's block table: slot per row, -1: not from a page
        row_chunks = chunks[inverse]
        staged, pinned = None, []
        try:
            parts = []  # (chunk arrays, rows of this take, their chunk index in the arrays) to copy on the host
            if cached:  # hits: rows from their device pages, else from their host copies stacked in one array
                hit = np.fromiter(cached, np.int64, len(cached))
                hit_slots = self.pool.pin_many([(layer, kind, int(chunks[i])) for i in hit])
                pinned = hit_slots[hit_slots >= 0].tolist()
                slot_of = np.full(len(chunks), -1, np.int64)
                slot_of[hit] = hit_slots
                slots[:n] = slot_of[inverse]
                on_host = hit[hit_slots < 0]
                if len(on_host):
                    in_stack = np.full(len(chunks), -1, np.int64)
                    in_stack[on_host] = np.arange(len(on_host))
                    rows = np.flatnonzero(in_stack[inverse] >= 0)
                    parts.append((np.stack([cached[int(i)] for i in on_host]), rows, in_stack[inverse[rows]]))
            extent = _one_whole_extent(runs)  # with no host-buffer hit, every row not in a page is read
            if extent is not None and (parts or 2 * int((slots[:n] < 0).sum()) < extent.array.shape[0] * c):
                extent = None
            extent_table = None if extent is None else np.full((2, size), -1, np.int32)  # rows from the buffer
            for run in runs:
                arrays, good = run.verified.result()
                rows = np.flatnonzero((row_chunks >= run.first_chunk) & (row_chunks < run.first_chunk + run.n_chunks))
                index = row_chunks[rows] - run.first_chunk
                bad = ~good[index]
                if bad.any():
                    ok[rows[bad]] = False
                    rows, index = rows[~bad], index[~bad]
                if self.caching:  # placed once the first token is out (`close`)
                    used = np.flatnonzero(np.bincount(index, minlength=run.n_chunks))
                    self.cache.admit_later([(layer, kind, run.first_chunk + int(j)) for j in used],
                                           [arrays[j] for j in used])
                if extent is None:
                    parts.append((arrays, rows, index))
                else:
                    extent_table[0, rows] = run.first_chunk - extent.first_chunk + index
                    extent_table[1, rows] = offsets[rows]
            if extent is not None:
                read = self.pool.gather_extent(kind, extent.array, extent_table)
                if not self.caching:
                    return read, ok
                # through the pool even with no row in a page: its first take of this size compiles every step a
                # later one may need, whatever the device tier then holds
                return self.pool.gather(kind, slots, padded(offsets, size, 0), read), ok
            for arrays, rows, index in parts:
                if len(rows):
                    if staged is None:
                        staged = np.zeros((lay.heads(kind), size, lay.head_dim), lay.np_dtype)
                    staged[:, rows] = arrays[index, :, offsets[rows]].swapaxes(0, 1)
            return self.pool.gather(kind, slots, padded(offsets, size, 0), staged), ok
        finally:
            self.pool.unpin(kind, pinned)

    def compile_assembly(self, kind: int, size: int) -> None:
        """Compile every device step of a take of `size` rows (stores.pool.DevicePool.compile)."""
        self.pool.compile(kind, size)

    def close(self) -> None:
        """The request is over (its first token is out): drop its open tickets, then place in the caches what it read
        and promote its host hits (`TieredCache.settle`), and write the device tier's new pages, all off the path
        to its first token."""
        with self._lock:
            for tickets in list(self._tickets.values()):
                for t in list(tickets):
                    self._cancel_locked(t)
        if self.caching:
            self.cache.settle()
            self.pool.flush()


def _one_whole_extent(runs):
    """The one buffer every run landed in, if it spans its whole segment (`stores.reads.Extent`); else None."""
    extents = {id(run.extent): run.extent for run in runs}
    if len(extents) != 1:
        return None
    (extent,) = extents.values()
    return extent if extent is not None and extent.whole else None
