"""The disk read path of a store: chunk reads coalesced into runs through the disk's read scheduler, each
chunk checked against its heads' checksums before it is served; gathering token positions from the chunks read.

Under tensor parallelism (`ChunkReads.split_reads`) a kind whose heads the mesh splits is read as each device's
own heads' byte ranges of every chunk file, and each device's bytes are counted (`StoreMetrics.device_bytes`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging

import numpy as np

from specjax.stores import kvarray
from specjax.stores.manifest import head_checksums
from specjax.stores.scheduler import when_all

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Locations:
    """Where requested token positions live: chunk id and slot offset inside it, per position."""
    chunks: np.ndarray
    offsets: np.ndarray

    def unique_chunks(self) -> np.ndarray:
        return np.unique(self.chunks)


@dataclasses.dataclass
class Gathered:
    """Vectors `[heads, n, head_dim]` in the requested order; `ok[i]` False where a bad chunk must be recomputed."""
    array: np.ndarray
    ok: np.ndarray


@dataclasses.dataclass(eq=False)
class _Run:
    """One disk read of adjacent chunks (a scheduler `Read`) and how many of them are no longer wanted."""
    read: object
    n_chunks: int
    unwanted: int = 0


@dataclasses.dataclass(eq=False)
class ChunkRead:
    """One chunk's share of a run read: `future` resolves with the verified chunk (None if bad)."""
    layer: int
    kind: int
    chunk: int
    run: _Run
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)


def _runs(chunks: list[int], max_chunks: int) -> list[tuple[int, int]]:
    """(first, count) runs of consecutive chunk ids among `chunks`, each at most `max_chunks` long."""
    runs = []
    for c in sorted(set(chunks)):
        if runs and runs[-1][0] + runs[-1][1] == c and runs[-1][1] < max_chunks:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((c, 1))
    return runs


class ChunkReads:
    """Reading chunks and located positions (mixed into `KVStore`: uses its layout, arrays, metrics, lock
    and `_expected_checksums`)."""

    def split_reads(self, devices: dict[int, int]) -> None:
        """Read kind `k`'s chunks as `devices[k]` byte ranges of equal head counts, one per device of a mesh that
        splits those heads (1, or a kind left out: whole chunk files). Set once per store handle; an engine on
        another mesh needs its own handle."""
        parts = {kind: int(devices.get(kind, 1)) for kind in self.layout.kinds()}
        for kind, n in parts.items():
            if n < 1 or self.layout.heads(kind) % n:
                raise ValueError(f"{kvarray.KIND_NAMES[kind]}: {self.layout.heads(kind)} heads cannot be read in "
                                 f"{n} equal parts")
        with self._lock:
            current = self._head_parts or {kind: 1 for kind in self.layout.kinds()}
            if current != parts and self._reads_started:
                raise ValueError(f"this store handle has read its chunks in head parts {current}; "
                                 f"open another handle for parts {parts}")
            self._head_parts = parts

    def _parts(self, kind: int) -> int:
        return 1 if self._head_parts is None else self._head_parts[kind]

    @property
    def scheduler(self):
        """The disk's read queue (stores.scheduler): its measured rate, what waits in it."""
        return self._arrays.scheduler

    def read_chunks(self, layer: int, kind: int, chunks, *, speculative: bool = False,
                    background: bool = False) -> list[ChunkRead]:
        """Read chunks of one layer and kind: runs of adjacent ids go to the disk as one read (at most
        `max_read_bytes`, by default as large as the disk's scheduler allows), at the scheduler's priority
        `speculative` / `background` (stores.scheduler). Each `ChunkRead.future` resolves with its verified chunk
        `[heads, chunk_tokens, head_dim]`, or None if it is bad (counted), and is cancelled if its read was
        withdrawn unread."""
        chunks = [int(c) for c in chunks]
        expected = {c: self._expected_checksums(layer, kind, c) for c in chunks}
        for c, e in expected.items():
            if e is None:
                raise KeyError(f"chunk {c} belongs to no segment of the store")
        self._reads_started = True
        reads = []
        max_bytes = self.max_read_bytes or self._arrays.scheduler.max_read_bytes()
        head_parts = self._parts(kind)
        for first, n in _runs(chunks, max(1, max_bytes // self.layout.chunk_nbytes(kind))):
            run = _Run(self._arrays.read_run(layer, kind, first, n, speculative=speculative, background=background,
                                             head_parts=head_parts), n)
            parts = [ChunkRead(layer, kind, first + j, run) for j in range(n)]
            run.read.future.add_done_callback(functools.partial(self._verify, parts, expected))
            reads += parts
        order = {r.chunk: r for r in reads}
        return [order[c] for c in chunks]

    def _verify(self, parts: list, expected: dict, f) -> None:
        """Check each chunk of a landed run against its heads' checksums before it is served."""
        if f.cancelled():  # withdrawn before it was read: nothing was read
            for part in parts:
                part.future.cancel()
            return
        first = parts[0]
        try:
            arrays = f.result()
        except Exception as e:  # noqa: BLE001 -- unreadable chunks: misses, never an exception to serve
            log.warning("chunks %d..%d layer %d %s unreadable: %s", first.chunk, parts[-1].chunk, first.layer,
                        kvarray.KIND_NAMES[first.kind], e)
            self.metrics.add(bad_chunks=len(parts))
            for part in parts:
                part.future.set_result(None)
            return
        nbytes = sum(a.nbytes for a in arrays)
        self.metrics.add(disk_bytes=nbytes, probe_disk_bytes=nbytes if first.kind == kvarray.PROBE else 0,
                         chunks_read=len(parts), read_requests=1)
        devices = self._parts(first.kind)
        if devices > 1:  # each device read its own heads' byte range of every chunk file
            self.metrics.add_device_bytes([nbytes // devices] * devices)
        for part, chunk in zip(parts, arrays):
            if head_checksums(chunk) != expected[part.chunk]:
                log.warning("chunk %d layer %d %s fails its checksum", part.chunk, part.layer,
                            kvarray.KIND_NAMES[part.kind])
                self.metrics.add(bad_chunks=1)
                part.future.set_result(None)
            else:
                part.future.set_result(chunk)

    def read_chunk(self, layer: int, kind: int, chunk: int, *, speculative: bool = False) -> concurrent.futures.Future:
        """Future of one verified chunk `[heads, chunk_tokens, head_dim]`, or of None if it is bad (counted)."""
        return self.read_chunks(layer, kind, [chunk], speculative=speculative)[0].future

    def expedite(self, read: ChunkRead) -> None:
        """A speculative read is needed now: its run joins the disk's demand queue (if it has not been issued)."""
        self._arrays.scheduler.expedite(read.run.read)

    def waiting(self, read: ChunkRead) -> bool:
        """Is the chunk's read still queued, not yet asked of the disk?"""
        return self._arrays.scheduler.waiting(read.run.read)

    def withdraw(self, read: ChunkRead) -> None:
        """A speculative chunk is no longer wanted; once no chunk of its run is, a run not yet issued is dropped
        unread (its futures cancelled, nothing counted as read)."""
        with self._lock:
            read.run.unwanted += 1
            done = read.run.unwanted == read.run.n_chunks
        if done:
            self._arrays.scheduler.withdraw(read.run.read)

    def read_locations(self, layer: int, kind: int, loc: Locations) -> concurrent.futures.Future:
        """Future of `Gathered` for the located positions; chunks are read concurrently."""
        lay = self.layout
        chunks, inverse = np.unique(loc.chunks, return_inverse=True)
        futures = [r.future for r in self.read_chunks(layer, kind, chunks)]
        self.metrics.add(used_token_bytes=len(loc.chunks) * lay.token_nbytes(kind))

        def assemble(arrays):
            out = np.zeros((lay.heads(kind), len(loc.chunks), lay.head_dim), lay.np_dtype)
            ok = np.ones(len(loc.chunks), bool)
            for i, array in enumerate(arrays):
                sel = np.flatnonzero(inverse == i)
                if array is None:
                    ok[sel] = False
                else:
                    out[:, sel] = array[:, loc.offsets[sel]]
            return Gathered(out, ok)

        return when_all(futures, assemble)
