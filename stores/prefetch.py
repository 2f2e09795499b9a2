"""Host-side asynchronous prefetcher: `request` starts chunk reads and returns at once, `take` waits only for
what is still missing and hands back device arrays in original token order.

Reads go to the store as runs of adjacent chunks (one disk request each) through the disk's read scheduler. The
prefetcher's books are numpy arrays per (layer, kind) with a slot per chunk read (`HeldReads`): holding, taking and
letting go of a layer's chunks is a few array steps, not a Python object or step per chunk.
A take reads its tokens out of the tiers' page arrays (stores.pool) through a block table: device-cache hits from
their device pages; host-cache hits from the host tier's pages, read in place where the device reads host memory (a
CPU device) and otherwise copied, with the rows just read from disk, into one host array of only the rows no device
page holds, which crosses in one copy. That is two or three device steps per take, however many chunks it touches.

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

from specjax.idsets import distinct
from specjax.shapes import padded
from specjax.stores.caches import TieredCache, chunk_keys
from specjax.stores.held_reads import HeldReads
from specjax.stores.pool import DevicePool, HostPages, copy_rows, staged_size, staging
from specjax.stores.store import KVStore, Locations, Match


@dataclasses.dataclass
class Ticket:
    layer: int
    kind: int
    holds: list  # slot arrays (`HeldReads`) of the chunks it holds
    speculative: bool
    table: HeldReads | None = None
    released: bool = False
    # held until the caller cancels it (or the prefetcher closes), not let go of when its (layer, kind) is taken: a
    # read that several takes of one layer use (`request(held=True)`)
    held: bool = False

    @property
    def keys(self) -> list:
        """(layer, kind, chunk) of every chunk the ticket holds (none once released)."""
        if self.released:
            return []
        return [(self.layer, self.kind, c) for slots in self.holds for c in self.table.chunk[slots].tolist()]


@dataclasses.dataclass
class Taken:
    """`array` `[heads, n, head_dim]` on the device in the requested order; `ok[i]` False where a chunk was
    bad (zeros there: recompute those tokens); `waited_ms` is the time `take` blocked on I/O."""
    array: jax.Array
    ok: np.ndarray
    waited_ms: float
    chunks_from_disk: int
    # when its device steps were dispatched (monotonic; None: it dispatched none): from then until `array` is ready
    # the take is device work (a CPU device runs a small step on the dispatching thread, within the dispatch)
    dispatched_at: float | None = None


@dataclasses.dataclass(eq=False)
class Resident:
    """Where every position of a layer's reused prefix lies in the page arrays the device reads, for takes whose rows
    the device chooses (`Prefetcher.resident`): `table` [4, size] (slot, offset, unused, host slot per position, -1
    where the position is in no such page), for `loc`, the positions' locations; `pinned`: the device slots it
    names, held until the take is accounted for or discarded."""

    layer: int
    kind: int
    loc: Locations
    table: np.ndarray
    pinned: list


class Prefetcher:
    """Moves chunks disk -> host -> device ahead of use, within `max_buffer_bytes` of staged speculative reads."""

    def __init__(self, store: KVStore, cache: TieredCache | None = None, *, max_buffer_bytes: int = 256 << 20,
                 pcie_bandwidth: float | None = None):
        """`pcie_bandwidth`: bytes/s of an emulated host->device link (None: not throttled)."""
        self.store, self.cache = store, cache
        self.max_buffer_bytes = max_buffer_bytes
        self._tables: dict = {}  # (layer, kind) -> HeldReads of the reads held
        self._buffered = 0
        self._tickets: dict = {}   # (layer, kind) -> open tickets
        self._lock = threading.Lock()
        gpu_cache_bytes = cache.gpu_cache_bytes if cache is not None else 0
        self.pool = DevicePool(store.layout, gpu_cache_bytes, metrics=store.metrics, pcie_bandwidth=pcie_bandwidth)
        if cache is not None:
            cpu_cache_bytes = cache.cpu_cache_bytes
            self.pool.host_pages = HostPages(store.layout, cpu_cache_bytes) if cpu_cache_bytes > 0 else None
            cache.attach(self.pool, self.pool.host_pages)
            store.on_free(cache.invalidate)

    @property
    def buffered_bytes(self) -> int:
        return self._buffered

    def _table(self, layer: int, kind: int) -> HeldReads:
        table = self._tables.get((layer, kind))
        if table is None:
            table = self._tables[(layer, kind)] = HeldReads()
        return table

    def _hold(self, layer: int, kind: int, chunks, demand: bool, background: bool = False) -> np.ndarray:
        """Hold the reads of (layer, kind) for `chunks` (distinct ids), issuing those not in flight as coalesced
        reads (speculative ones `background` at the disk if asked); speculative reads respect the buffer bound, and
        a demand for a speculative read in flight expedites it. Returns the slots held (`HeldReads`)."""
        chunks = np.asarray(chunks, np.int64)
        table = self._table(layer, kind)
        slots = table.find(chunks)
        held = slots[slots >= 0]
        table.holders[held] += 1
        if demand:
            waiting = held[table.speculative[held]]
            if len(waiting):
                table.speculative[waiting] = False
                for r, _ in table.runs_of(waiting):
                    self.store.expedite(table.runs[r])
        new = chunks[slots < 0]
        nbytes = self.store.layout.chunk_nbytes(kind)
        if not demand:  # within the bound on staged speculative reads
            new = new[:max(0, (self.max_buffer_bytes - self._buffered) // nbytes)]
        if len(new):
            runs = self.store.read_runs(layer, kind, new, speculative=not demand, background=background)
            added = table.add(runs, speculative=not demand)
            self._buffered += nbytes * len(added)
            held = np.concatenate([held, added])
        return held

    def _release(self, layer: int, kind: int, slots: np.ndarray) -> None:
        """Let go of slots (`_hold`); the chunks nobody holds any more are forgotten: a speculative read nobody
        needed is withdrawn (one the disk has not been asked for yet is never read); any other read completes and
        is offered to the caches if no take used it."""
        table = self._table(layer, kind)
        table.holders[slots] -= 1
        gone = slots[table.holders[slots] == 0]  # a hold's slots are distinct, each held by it until now
        if not len(gone):
            return
        self._buffered -= self.store.layout.chunk_nbytes(kind) * len(gone)
        for r, spec in table.runs_of(gone[table.speculative[gone]]):
            self.store.withdraw(table.runs[r], len(spec))
        if self.caching:
            for r, unused in table.runs_of(gone[~table.taken[gone]]):
                run = table.runs[r]
                run.verified.add_done_callback(functools.partial(
                    self._keep_unused, layer, kind, run.first_chunk, table.chunk[unused].tolist()))
        table.forget(gone)

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
                speculative: bool = False, background=(), held: bool = False) -> Ticket:
        """Start reading the chunks of `positions` (or the chunk ids `chunks`, already located) not already cached;
        returns immediately. With `speculative`, the chunk ids `background` are read too, but only while the disk
        has nothing else to do (stores.scheduler). A new request for the same (layer, kind) supersedes earlier
        speculative ones (their unshared reads are dropped). A take of (layer, kind) lets go of its open tickets,
        except `held` ones: the caller lets go of those (`let_go`) once every take that uses them is made, so that a
        second take of the kind in the layer finds their chunks still read."""
        if len(background) and not speculative:
            raise ValueError("background reads are speculative")
        if held and speculative:
            raise ValueError("a held read is a demand read")
        if chunks is None:
            chunks = self.store.locate(match, positions, layer).unique_chunks()
        if self.caching:
            chunks = np.asarray(chunks, np.int64)
            chunks = chunks[~self.cache.holds_many(layer, kind, chunks)]
            if len(background):
                background = np.asarray(background, np.int64)
                background = background[~self.cache.holds_many(layer, kind, background)]
        with self._lock:
            holds = [self._hold(layer, kind, chunks, demand=not speculative)]
            if len(background):
                holds.append(self._hold(layer, kind, background, demand=False, background=True))
            ticket = Ticket(layer, kind, holds, speculative, self._table(layer, kind), held=held)
            open_tickets = self._tickets.setdefault((layer, kind), [])
            for old in [t for t in open_tickets if t.speculative]:
                self._cancel_locked(old)
            open_tickets.append(ticket)
        return ticket

    def _cancel_locked(self, ticket: Ticket) -> None:
        if not ticket.released:
            ticket.released = True
            for slots in ticket.holds:
                self._release(ticket.layer, ticket.kind, slots)
            tickets = self._tickets.get((ticket.layer, ticket.kind), [])
            if ticket in tickets:
                tickets.remove(ticket)

    def cancel(self, ticket: Ticket) -> None:
        with self._lock:
            self._cancel_locked(ticket)

    def let_go(self, layer: int) -> None:
        """Cancel the layer's held tickets (`request(held=True)`), of every kind."""
        with self._lock:
            held = [t for (of, _), tickets in self._tickets.items() if of == layer for t in tickets if t.held]
            for ticket in held:
                self._cancel_locked(ticket)

    def ahead(self, layer: int, kind: int, chunks) -> np.ndarray:
        """Per chunk of (layer, kind): is it on its way already, held by a cache tier or its read asked of the disk?
        (False: a take now would have to read it, or expedite a read still waiting in the disk's queue.)"""
        chunks = np.asarray(chunks, np.int64)
        out = np.zeros(len(chunks), bool) if self.cache is None else self.cache.holds_many(layer, kind, chunks)
        with self._lock:
            table = self._table(layer, kind)
            slots = table.find(chunks)
            todo = np.flatnonzero(~out & (slots >= 0))
            run_of = table.run_of[slots[todo]]
            for r in distinct(run_of).tolist():
                out[todo[run_of == r]] = not self.store.waiting(table.runs[r])
        return out

    def wait(self, tickets, timeout: float | None = None) -> bool:
        """Block until every read the tickets started has landed (at most `timeout` seconds); True if they have.

        For the layers that must arrive before computing (ContiguousKV's sub-period), and for a caller that may
        have to give up (Cake's loader, once the device has computed the chunk) and so waits in short slices."""
        with self._lock:
            runs = [t.table.runs[r] for t in tickets if not t.released for slots in t.holds
                    for r, _ in t.table.runs_of(slots)]
            futures = {id(run): run.verified for run in runs if run is not None}
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
            found = self.cache.lookup_many(chunk_keys(layer, kind, chunks), counts.tolist(),
                                           chunk_tokens=lay.chunk_tokens, importance=importance_of)
            cached = {i: array for i, array in enumerate(found) if array is not None}
        else:
            self.store.metrics.add(misses=len(chunks))
        missing = chunks
        if cached:
            missing = np.delete(chunks, np.fromiter(cached, np.int64, len(cached)))
        with self._lock:
            demand = self._hold(layer, kind, missing, demand=True)
            table = self._table(layer, kind)
            table.taken[demand] = True
            runs = [table.runs[r] for r, _ in table.runs_of(demand)]  # the run reads holding the missing chunks
        start = time.perf_counter()
        concurrent.futures.wait([run.verified for run in runs])
        waited_ms = (time.perf_counter() - start) * 1e3
        try:
            array, ok, dispatched_at = self._assemble(layer, kind, chunks, inverse, loc.offsets, size, cached, runs)
        finally:
            with self._lock:
                self._release(layer, kind, demand)
                self._cancel_tickets_locked(layer, kind)
        return Taken(array, ok, waited_ms, len(missing), dispatched_at)

    def resident(self, layer: int, kind: int, loc: Locations, size: int) -> Resident | None:
        """The block table of every position of `loc` (a layer's reused prefix) in the pages the device reads, for
        `DevicePool.gather_rows`, its device slots pinned; None where no tier has such pages (caches off, or only a
        host tier the device cannot read in place). Chunks this request read and no tier holds yet are in no page."""
        if not self.caching or not self.pool.readable(kind):
            return None
        chunks, inverse = loc.chunk_index
        keys = chunk_keys(layer, kind, chunks)
        slots = self.pool.pin_many(keys)
        host_pages = self.cache.host_pages
        on_host = (host_pages.slots(keys) if host_pages is not None and host_pages.on_device(kind) is not None
                   else np.full(len(chunks), -1, np.int64))
        table = np.full((4, size), -1, np.int32)
        n = len(inverse)
        table[0, :n], table[1, :n], table[3, :n] = slots[inverse], loc.offsets, on_host[inverse]
        return Resident(layer, kind, loc, table, slots[slots >= 0].tolist())

    def took_resident(self, resident: Resident, positions: np.ndarray) -> None:
        """`positions` of `resident` were taken on the device (`DevicePool.gather_rows`), every one from a page: count
        them as `take` counts a take served from the caches (uses, hits, the host pages' rows that crossed) and let go
        of the layer's open tickets of that kind. The caller then `discard`s it."""
        layer, kind, lay = resident.layer, resident.kind, self.store.layout
        positions = np.asarray(positions, np.int64)
        nbytes = len(positions) * lay.token_nbytes(kind)
        self.store.metrics.add(used_token_bytes=nbytes, chosen_on_device_bytes=nbytes)
        chunks, inverse = distinct(resident.loc.chunks[positions], return_inverse=True)
        self.cache.lookup_many(chunk_keys(layer, kind, chunks), np.bincount(inverse).tolist(),
                               chunk_tokens=lay.chunk_tokens)
        self.pool.count_host_rows(kind, int(((resident.table[0, positions] < 0)
                                             & (resident.table[3, positions] >= 0)).sum()))
        with self._lock:
            self._cancel_tickets_locked(layer, kind)

    def _cancel_tickets_locked(self, layer: int, kind: int) -> None:
        """The layer's `kind` is taken: its open tickets (a guess's reads among them) are let go, but for held ones."""
        for ticket in list(self._tickets.get((layer, kind), [])):
            if not ticket.held:
                self._cancel_locked(ticket)

    def discard(self, resident: Resident) -> None:
        """`resident`'s take did not happen (or is accounted for): unpin its slots."""
        pinned, resident.pinned = resident.pinned, []
        self.pool.unpin(resident.kind, pinned)

    @property
    def caching(self) -> bool:
        """Does either cache tier have room? (With both off, takes skip every per-chunk cache step.)"""
        return self.cache is not None and (self.cache.gpu_cache_bytes > 0 or self.cache.cpu_cache_bytes > 0)

    def _assemble(self, layer: int, kind: int, chunks: np.ndarray, inverse: np.ndarray, offsets: np.ndarray,
                  size: int, cached: dict, runs) -> tuple[jax.Array, np.ndarray, float]:
        """The take's `[heads, size, d]` on the device, its `ok` rows and when its device steps were dispatched.

        Rows of cache hits come from their device pages (block table) where the device tier keeps them, else from a
        host buffer. Rows read from disk: when every run landed in one segment's landing buffer (its layer's certain
        reads, or a guess and the demand read after it, side by side: `stores.reads.Extent`), no hit needs the host
        buffer and the take needs at least half of the buffer's tokens (whole pages then cost at most twice the link
        bytes of the needed vectors; a layer's certain reads need all of them), that buffer crosses as it is and the
        device gathers those rows; else they are copied into the host buffer too (one indexing step per landing
        buffer, however many runs landed in it), which crosses in one copy. With the caches on, every chunk read is
        offered to them, placed once the request's first token is out (`close`)."""
        lay = self.store.layout
        c = lay.chunk_tokens
        n = len(inverse)
        ok = np.ones(n, bool)
        slots = np.full(size, -1, np.int64)  # the take's block table: slot per row, -1: not from a page
        host_slots = None  # per row, its host page where the device reads them in place (-1: not from one)
        row_chunks = chunks[inverse]
        pinned = []
        try:
            parts = []  # (chunk arrays, rows of this take, their chunk index in the arrays) to copy on the host
            if cached:
                pinned, host_slots = self._hits(layer, kind, chunks, inverse, size, cached, slots, parts)
            in_page = slots[:n] >= 0 if host_slots is None else (slots[:n] >= 0) | (host_slots[:n] >= 0)
            extent = _one_extent(runs)  # with no host-buffer hit, every row not in a page is read
            if extent is not None and (parts or 2 * int((~in_page).sum()) < extent.array.shape[0] * c):
                extent = None
            extent_table = None if extent is None else np.full((2, size), -1, np.int32)  # rows from the buffer
            self._route_runs(layer, kind, runs, row_chunks, offsets, ok, parts, extent_table)
            if extent is not None:
                dispatched_at = time.monotonic()
                read = self.pool.gather_extent(kind, extent.array, extent_table)
                if not self.caching:
                    return read, ok, dispatched_at
                # through the pool even with no row in a page: its first take of this size compiles every step a
                # later one may need, whatever the device tier then holds
                return (self.pool.gather(kind, slots, padded(offsets, size, 0), read, host_slots=host_slots), ok,
                        dispatched_at)
            array, dispatched_at = self._gather_parts(kind, size, offsets, slots, host_slots, in_page, parts, ok)
            return array, ok, dispatched_at
        finally:
            self.pool.unpin(kind, pinned)

    def _route_runs(self, layer: int, kind: int, runs, row_chunks: np.ndarray, offsets: np.ndarray, ok: np.ndarray,
                    parts: list, extent_table: np.ndarray | None) -> None:
        """Route each run's verified rows (a bad chunk's rows marked not `ok`): into `extent_table` (its chunk in the
        landing buffer, its offset) where the take's one landing buffer crosses as it is; else onto `parts` (chunk
        arrays, rows, their chunk index), one part per landing buffer however many runs landed in it, so each buffer
        costs one copy step. With the caches on, every chunk a run read is offered to them, placed once the
        request's first token is out (`close`)."""
        in_buffers = {}  # id(extent) -> (extent, [rows], [their chunk in it])
        for run in runs:
            arrays, good = run.verified.result()
            rows, index = run.rows(row_chunks, good, ok)
            if self.caching:  # placed once the first token is out (`close`)
                used = np.flatnonzero(np.bincount(index, minlength=run.n_chunks))
                if len(used):
                    self.cache.admit_later(chunk_keys(layer, kind, run.first_chunk + used), _views(arrays, used))
            if run.extent is None:
                parts.append((arrays, rows, index))
                continue
            index = run.first_chunk - run.extent.first_chunk + index
            if extent_table is not None:
                extent_table[0, rows], extent_table[1, rows] = index, offsets[rows]
                continue
            _, buffer_rows, buffer_index = in_buffers.setdefault(id(run.extent), (run.extent, [], []))
            buffer_rows.append(rows)
            buffer_index.append(index)
        parts += [(e.array, np.concatenate(rows), np.concatenate(index)) for e, rows, index in in_buffers.values()]

    def _gather_parts(self, kind: int, size: int, offsets: np.ndarray, slots: np.ndarray, host_slots, in_page,
                      parts: list, ok: np.ndarray) -> tuple[jax.Array, float]:
        """A take's rows on the device, and when its steps were dispatched: the rows of `parts` (chunk arrays, their
        rows, their chunk index) copied into one host array, only the rows in no page where some are (an array of
        `staged_size`), crossing in one copy, then gathered with the pages' rows; a bad chunk's rows are zeros."""
        lay = self.store.layout
        n = len(ok)
        staged, shape, staged_at, count = None, (lay.heads(kind), size, lay.width(kind)), None, n
        if in_page.any():  # only the rows not in a page cross, in an array of their own
            host_rows = np.flatnonzero(~in_page)
            staged_at = np.full(size, -1, np.int64)  # each take row's row of that array
            staged_at[host_rows] = np.arange(len(host_rows))
            shape = (shape[0], staged_size(size, len(host_rows)), shape[2])
            count = shape[1]  # rows past the host rows are never gathered: nothing to zero
        for arrays, rows, index in parts:
            if len(rows):
                if staged is None:
                    staged = staging(shape, lay.dtype_of(kind), count)
                copy_rows(staged, rows if staged_at is None else staged_at[rows], arrays, index, offsets[rows])
        dispatched_at = time.monotonic()
        if not ok.all():  # a bad chunk's rows: zeros
            if staged_at is not None:
                staged_at[np.flatnonzero(~ok)] = -1
            elif staged is not None:
                staged[:, np.flatnonzero(~ok)] = 0
        return self.pool.gather(kind, slots, padded(offsets, size, 0), staged, staged_at, host_slots), dispatched_at

    def _hits(self, layer: int, kind: int, chunks: np.ndarray, inverse: np.ndarray, size: int, cached: dict,
              slots: np.ndarray, parts: list) -> tuple[list, np.ndarray | None]:
        """Where a take's cache hits come from: rows of device pages into `slots` (the take's block table), else rows
        of the host tier's pages (read in place by a device that reads host memory: the host slots returned; else
        copied, added to `parts`), else the chunks this request read, from their read buffers stacked in one array
        (added to `parts`). Returns (the device slots pinned, the host slots per row or None); on failure nothing stays
        pinned."""
        n, host_slots = len(inverse), None
        hit = np.fromiter(cached, np.int64, len(cached))
        hit_slots = self.pool.pin_many(chunk_keys(layer, kind, chunks[hit]))
        pinned = hit_slots[hit_slots >= 0].tolist()
        try:
            slot_of = np.full(len(chunks), -1, np.int64)
            slot_of[hit] = hit_slots
            slots[:n] = slot_of[inverse]
            on_host = hit[hit_slots < 0]
            host_pages = self.cache.host_pages
            if len(on_host) and host_pages is not None:  # host-tier hits: rows of its page array
                page_of = np.full(len(chunks), -1, np.int64)
                page_of[on_host] = host_pages.slots(chunk_keys(layer, kind, chunks[on_host]))
                rows = np.flatnonzero(page_of[inverse] >= 0)
                if len(rows) and host_pages.on_device(kind) is not None:
                    host_slots = np.full(size, -1, np.int64)
                    host_slots[rows] = page_of[inverse[rows]]
                elif len(rows):
                    parts.append((host_pages.array(kind), rows, page_of[inverse[rows]]))
                on_host = on_host[page_of[on_host] < 0]
            if len(on_host):  # chunks this request read, served from their read buffers
                in_stack = np.full(len(chunks), -1, np.int64)
                in_stack[on_host] = np.arange(len(on_host))
                rows = np.flatnonzero(in_stack[inverse] >= 0)
                parts.append((np.stack(list(map(cached.__getitem__, on_host.tolist()))), rows,
                              in_stack[inverse[rows]]))
        except BaseException:
            self.pool.unpin(kind, pinned)
            raise
        return pinned, host_slots

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


def _views(arrays: np.ndarray, index: np.ndarray) -> list:
    """arrays[i] for i in `index` (ascending), as views (a run of adjacent chunks without a Python step per chunk)."""
    lo, hi = int(index[0]), int(index[-1]) + 1
    return list(arrays[lo:hi]) if hi - lo == len(index) else [arrays[i] for i in index.tolist()]


def _one_extent(runs):
    """The one landing buffer every run landed in (`stores.reads.Extent`), or None."""
    extents = {id(run.extent): run.extent for run in runs}
    return next(iter(extents.values())) if len(extents) == 1 else None
