"""Host-side asynchronous prefetcher: `request` starts chunk reads and returns at once, `take` waits only for
what is still missing and hands back device arrays in original token order.

Reads are store futures whose done-callbacks stage verified chunks in bounded host buffers; `take` moves the
needed vectors to the device through the caches (score update, placement, host->device copy of only those).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.stores.caches import TieredCache, pad_rows, row_bucket
from specjax.stores.store import KVStore, Match


@dataclasses.dataclass
class _Entry:
    future: object            # concurrent future of the verified chunk (None if bad)
    nbytes: int
    speculative: bool         # issued ahead of need and not yet needed (yields to demand reads on the link)
    holders: int = 0
    taken: bool = False       # a `take` used it (and offered it to the caches)


@dataclasses.dataclass
class Ticket:
    layer: int
    kind: int
    keys: list
    speculative: bool
    released: bool = False


@dataclasses.dataclass
class Taken:
    """`array` `[heads, n, head_dim]` on the device in the requested order; `ok[i]` False where a chunk was
    bad (zeros there: recompute those tokens); `waited_ms` is the time `take` blocked on I/O."""
    array: jax.Array
    ok: np.ndarray
    waited_ms: float
    chunks_from_disk: int


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_rows(out, part, idx):
    return out.at[:, idx].set(part.astype(out.dtype), mode="drop")


class Prefetcher:
    """Moves chunks disk -> host -> device ahead of use, within `max_buffer_bytes` of staged reads."""

    def __init__(self, store: KVStore, cache: TieredCache | None = None, *, max_buffer_bytes: int = 256 << 20):
        self.store, self.cache = store, cache
        self.max_buffer_bytes = max_buffer_bytes
        self._entries: dict = {}
        self._buffered = 0
        self._tickets: dict = {}   # (layer, kind) -> open tickets
        self._lock = threading.Lock()
        if cache is not None:
            store.on_free(cache.invalidate)

    @property
    def buffered_bytes(self) -> int:
        return self._buffered

    def _hold(self, key, demand: bool) -> bool:
        """Hold (issuing if needed) the read of `key`; speculative reads respect the buffer bound, and a demand
        for a speculative read in flight makes it urgent."""
        entry = self._entries.get(key)
        if entry is None:
            nbytes = self.store.layout.chunk_nbytes(key[1])
            if not demand and self._buffered + nbytes > self.max_buffer_bytes:
                return False
            entry = _Entry(self.store.read_chunk(*key, speculative=not demand), nbytes, speculative=not demand)
            self._entries[key] = entry
            self._buffered += nbytes
        elif demand and entry.speculative:
            entry.speculative = False
            self.store.expedite(*key)
        entry.holders += 1
        return True

    def _release_keys(self, keys) -> None:
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.holders -= 1
            if entry.holders <= 0:
                # Forgotten here: a speculative read nobody needed is withdrawn (on an emulated disk link one
                # that has not started is never read); any other read completes and is offered to the caches.
                del self._entries[key]
                self._buffered -= entry.nbytes
                if entry.speculative:
                    self.store.withdraw(*key)
                if not entry.taken and self.cache is not None:
                    entry.future.add_done_callback(functools.partial(self._keep_unused, key))

    def _keep_unused(self, key, future) -> None:
        """A read nobody took (a speculation the layer's real set superseded) was paid for: the caches place it
        by its score like any chunk read from disk, so it evicts only what their policy values less."""
        if future.cancelled():  # withdrawn before it was read
            return
        array = future.result()
        if array is not None:
            self.cache.admit(key, array)

    def request(self, match: Match, layer: int, kind: int, positions, *, speculative: bool = False) -> Ticket:
        """Start reading the chunks of `positions` not already cached; returns immediately. A new request for
        the same (layer, kind) supersedes earlier speculative ones (their unshared reads are dropped)."""
        chunks = self.store.locate(match, positions, layer).unique_chunks()
        keys = []
        with self._lock:
            for c in chunks:
                key = (layer, kind, int(c))
                if self.cache is not None and self.cache.where(key) is not None:
                    continue
                if self._hold(key, demand=not speculative):
                    keys.append(key)
            ticket = Ticket(layer, kind, keys, speculative)
            open_tickets = self._tickets.setdefault((layer, kind), [])
            for old in [t for t in open_tickets if t.speculative]:
                self._cancel_locked(old)
            open_tickets.append(ticket)
        return ticket

    def _cancel_locked(self, ticket: Ticket) -> None:
        if not ticket.released:
            ticket.released = True
            self._release_keys(ticket.keys)
            tickets = self._tickets.get((ticket.layer, ticket.kind), [])
            if ticket in tickets:
                tickets.remove(ticket)

    def cancel(self, ticket: Ticket) -> None:
        with self._lock:
            self._cancel_locked(ticket)

    def wait(self, tickets, timeout: float | None = None) -> bool:
        """Block until every read the tickets started has landed (at most `timeout` seconds); True if they have.

        For the layers that must arrive before computing (ContiguousKV's sub-period), and for a caller that may
        have to give up (Cake's loader, once the device has computed the chunk) and so waits in short slices."""
        with self._lock:
            futures = [self._entries[key].future for t in tickets for key in t.keys if key in self._entries]
        _, pending = concurrent.futures.wait(futures, timeout=timeout)
        return not pending

    def take(self, match: Match, layer: int, kind: int, positions, *, importance=None,
             pad_to: int | None = None) -> Taken:
        """Vectors of `positions` on the device; waits only for reads still in flight.

        `importance` (per position, optional) feeds the `attention_score` policy; the important fraction of
        each chunk for `spec_score` is taken as the share of its tokens requested here. `pad_to` >= the number
        of positions gives an array of that many tokens (zeros after the requested ones), so a caller that
        buckets its sizes compiles each device op once per bucket.
        """
        positions = np.asarray(positions, np.int64)
        loc = self.store.locate(match, positions, layer)
        chunks, inverse = np.unique(loc.chunks, return_inverse=True)
        lay = self.store.layout
        self.store.metrics.add(used_token_bytes=len(positions) * lay.token_nbytes(kind))
        imp = None if importance is None else np.asarray(importance, np.float64)
        parts, order, ok = [], [], np.ones(len(positions), bool)
        waiting = []
        with self._lock:
            demand_keys = []
            for i, c in enumerate(chunks):
                key, sel = (layer, kind, int(c)), np.flatnonzero(inverse == i)
                offsets = loc.offsets[sel]
                if self.cache is not None:
                    vectors = self.cache.access(key, offsets, chunk_tokens=lay.chunk_tokens,
                                                importance=None if imp is None else imp[sel].sum())
                    if vectors is not None:
                        parts.append(vectors)
                        order.append(sel)
                        continue
                self._hold(key, demand=True)
                self._entries[key].taken = True
                demand_keys.append(key)
                waiting.append((key, sel, offsets, self._entries[key].future))
        start = time.perf_counter()
        for _, _, _, future in waiting:
            future.result()
        waited_ms = (time.perf_counter() - start) * 1e3
        for key, sel, offsets, future in waiting:
            array = future.result()
            if array is None:
                ok[sel] = False
                parts.append(jnp.zeros((lay.heads(kind), row_bucket(len(sel)), lay.head_dim), lay.np_dtype))
            elif self.cache is not None:
                parts.append(self.cache.admit(key, array, offsets))
            else:
                host = np.ascontiguousarray(array[:, offsets])
                self.store.metrics.add(host_to_device_bytes=host.nbytes)
                parts.append(pad_rows(jax.device_put(host), row_bucket(len(sel))))
            order.append(sel)
        with self._lock:
            self._release_keys(demand_keys)
            for ticket in list(self._tickets.get((layer, kind), [])):
                self._cancel_locked(ticket)
        size = len(positions) if pad_to is None else pad_to
        if size < len(positions):
            raise ValueError(f"pad_to={pad_to} is smaller than the {len(positions)} positions asked for")
        return Taken(self._assemble(parts, order, size, lay, kind), ok, waited_ms, len(waiting))

    @staticmethod
    def _assemble(parts, order, size, lay, kind) -> jax.Array:
        """Scatter each chunk's vectors (`[heads, row_bucket(len(rows)), d]`, the caches' padded shape) to their
        rows of a [heads, size, d] array, so the device ops compile once per (output size, row bucket)."""
        out = jnp.zeros((lay.heads(kind), size, lay.head_dim), lay.np_dtype)
        for part, rows in zip(parts, order):
            idx = np.full(part.shape[1], size, np.int32)  # row `size` is out of range: its padding is dropped
            idx[: len(rows)] = rows
            out = _scatter_rows(out, part, jnp.asarray(idx))
        return out

    def close(self) -> None:
        with self._lock:
            for tickets in list(self._tickets.values()):
                for t in list(tickets):
                    self._cancel_locked(t)
