"""The disk read path of a store (`ChunkReader`): chunk reads coalesced into runs (byte ranges of one segment's
extent) through the disk's read scheduler, each run's chunks checked against their heads' checksums on the I/O thread
that landed it, before any is served; gathering token positions from the chunks read; the chunks' key summaries.

Under tensor parallelism (`ChunkReader.split_reads`) a kind whose heads the mesh splits is read as each device's
own heads' byte ranges of every chunk, and each device's bytes are counted (`StoreMetrics.device_bytes`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import threading
import typing
import weakref

import numpy as np

from specjax.idsets import distinct
from specjax.stores import kvarray
from specjax.stores.landing import BUFFERS
from specjax.stores.locations import Locations
from specjax.stores.manifest import chunk_checksums
from specjax.stores.scheduler import when_all

if typing.TYPE_CHECKING:
    from specjax.stores.index import StoreIndex
    from specjax.stores.match import Match
    from specjax.stores.metrics import StoreMetrics
    from specjax.stores.summaries import KeySummaries

log = logging.getLogger(__name__)

# a segment's layer and kind up to this size lands in one buffer (`_extents`); a new buffer's pages are faulted in
# once, a cost per byte (`benchmarks/results/cpu/segment-buffers`): free buffers are used again
SEGMENT_BUFFER_BYTES = 64 << 20


@dataclasses.dataclass
class Gathered:
    """Vectors `[heads, n, head_dim]` in the requested order; `ok[i]` False where a bad chunk must be recomputed."""
    array: np.ndarray
    ok: np.ndarray


@dataclasses.dataclass(eq=False)
class Extent:
    """A preallocated, page-aligned host buffer `[n, heads, chunk_tokens, head_dim]` for chunks `first_chunk ..
    first_chunk + n - 1` of one segment at one layer and kind. Every read of that segment's layer and kind lands in it,
    each run at its chunks' place, while any of them is alive: it spans the whole segment (`ChunkReader._extents`;
    past SEGMENT_BUFFER_BYTES, a buffer per read call spans the chunks that call reads). A layer's certain reads fill
    it; a speculative read and the demand read after it fill parts of it side by side, so a take of them crosses one
    buffer as it is, or copies its rows out of it in one step (stores.prefetch). Rows no read has landed hold
    anything: only rows of runs that landed are read."""
    array: np.ndarray
    first_chunk: int


@dataclasses.dataclass(eq=False)
class DiskRequest:
    """What the runs read by one disk request share: how many chunks it reads and how many are no longer wanted (it
    is withdrawn only once none is). No reference to the runs: nothing here keeps a run or its buffer alive."""
    n_chunks: int
    unwanted: int = 0


@dataclasses.dataclass(eq=False)
class Run:
    """Adjacent chunks of one segment, one byte range of its extent, read by one disk request (a scheduler `Read`,
    which may read other runs of the same call too: `DiskRequest`). `verified` resolves with `(chunks [n, heads,
    chunk_tokens, head_dim], ok [n])` once they are checked (ok False: bad, or the run unreadable; its rows are then
    not to be served); it is cancelled if the read was withdrawn unread.

    The run holds its `Read` weakly: the scheduler holds it until it has landed, and nothing a landed read did refers
    back to its run, so a run and its landing buffer are freed as soon as their readers let go, not at the next
    cycle collection (the buffer then serves another read: `stores.landing`)."""
    _read: "weakref.ref"
    first_chunk: int
    n_chunks: int
    request: DiskRequest  # what the runs of its disk request share
    verified: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    # the aligned host buffer of its segment's layer and kind the run's bytes land in, shared with every other read of
    # them alive (`Extent`); None where they stay in the read's own bytes (split reads)
    extent: "Extent | None" = None

    @property
    def read(self):
        """The scheduler's `Read`, or None once it has landed and been let go (nothing left to expedite or withdraw)."""
        return self._read()

    def rows(self, row_chunks: np.ndarray, good: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Of the rows of a take or gather (`row_chunks`: each row's chunk id), those whose chunk this run read and
        that passed their checks (`good`, per chunk of the run), with that chunk's index in the run; a row whose chunk
        failed is marked False in `ok`."""
        rows = np.flatnonzero((row_chunks >= self.first_chunk) & (row_chunks < self.first_chunk + self.n_chunks))
        index = row_chunks[rows] - self.first_chunk
        bad = ~good[index]
        if bad.any():
            ok[rows[bad]] = False
            rows, index = rows[~bad], index[~bad]
        return rows, index

    def chunk_future(self, chunk: int) -> concurrent.futures.Future:
        """A future of one of the run's chunks: the verified chunk, None if bad; cancelled with the run."""
        out: concurrent.futures.Future = concurrent.futures.Future()
        j = chunk - self.first_chunk

        def done(verified):  # refers to `out` only, not to the run
            if verified.cancelled():
                out.cancel()
                return
            arrays, ok = verified.result()
            out.set_result(arrays[j] if ok[j] else None)

        self.verified.add_done_callback(done)
        return out


@dataclasses.dataclass(eq=False)
class ChunkRead:
    """One chunk's share of a run read: `future` resolves with the verified chunk (None if bad). The future is made
    when first asked for, so a caller that works on whole runs (`run.verified`) pays nothing per chunk."""
    layer: int
    kind: int
    chunk: int
    run: Run
    _future: concurrent.futures.Future | None = None

    @property
    def future(self) -> concurrent.futures.Future:
        if self._future is None:
            self._future = self.run.chunk_future(self.chunk)
        return self._future


def _requests(runs: list[tuple], max_chunks: int) -> list[list[tuple]]:
    """`runs` (segment, first chunk, count) grouped into disk requests of consecutive runs of at most `max_chunks`
    chunks in all (0: one run a request)."""
    out, size = [], 0
    for run in runs:
        if out and max_chunks and size + run[2] <= max_chunks:
            out[-1].append(run)
            size += run[2]
        else:
            out.append([run])
            size = run[2]
    return out


class ChunkReader:
    """Reading one store's chunks and located positions: where they are and what they must hash to come from its
    index; the bytes from its chunk data (`index.arrays`) through the disk's scheduler. `max_read_bytes`: the largest
    read (None: as the read scheduler sizes reads for the disk)."""

    def __init__(self, index: "StoreIndex", metrics: "StoreMetrics", summaries: "KeySummaries", *,
                 max_read_bytes: int | None = None):
        self.index, self.layout, self.metrics, self.summaries = index, index.layout, metrics, summaries
        self.max_read_bytes = max_read_bytes
        self._arrays = index.arrays
        self._head_parts: dict[int, int] | None = None  # `split_reads`; None: whole chunk files
        self._own: dict[int, range] = {}  # `split_reads`: per kind, the head parts this process reads (absent: all)
        self._by_process: frozenset = frozenset()  # `split_reads`: kinds split among processes, not devices
        self._here = threading.local()  # `every_head`, on the thread that reads
        self._reads_started = False
        self._lock = threading.Lock()  # the head parts, what runs' shared disk requests still want, the live buffers
        # (layer, kind, segment's first chunk) -> its landing buffer while a run holds it (`_extents`); chunk ids are
        # never used again, so a buffer found here holds, where a read has landed, what any read of it would
        self._extents_alive: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def split_reads(self, devices: dict[int, int], own: dict[int, range] | None = None,
                    by_process: frozenset = frozenset()) -> None:
        """Read kind `k`'s chunks as `devices[k]` byte ranges of equal head counts, one per device of a mesh that
        splits those heads (1, or a kind left out: whole chunk files). `own[k]`: the parts this handle reads, its
        process's on a mesh over several processes (a kind left out, or None: every part); a chunk read then holds
        only those heads, the others' rows are left as they were, and only those heads are checked and counted.
        `by_process`: kinds whose parts are the processes' (each process's devices all hold its part), not the
        devices': their bytes are not counted per device. Set once per store handle; an engine on another mesh needs
        its own handle."""
        parts = {kind: int(devices.get(kind, 1)) for kind in self.layout.kinds()}
        for kind, n in parts.items():
            if n < 1 or self.layout.heads(kind) % n:
                raise ValueError(f"{kvarray.KIND_NAMES[kind]}: {self.layout.heads(kind)} heads cannot be read in "
                                 f"{n} equal parts")
            mine = (own or {}).get(kind)
            if mine is not None and not 0 <= mine.start < mine.stop <= n:
                raise ValueError(f"{kvarray.KIND_NAMES[kind]}: parts {mine.start}..{mine.stop - 1} of {n} to read")
        own = {kind: r for kind, r in (own or {}).items() if r != range(parts[kind])}
        with self._lock:
            current = self._head_parts or {kind: 1 for kind in self.layout.kinds()}
            if (current, self._own) != (parts, own) and self._reads_started:
                raise ValueError(f"this store handle has read its chunks in head parts {current}; "
                                 f"open another handle for parts {parts}")
            self._head_parts, self._own, self._by_process = parts, own, frozenset(by_process)

    def _parts(self, kind: int) -> int:
        return 1 if self._head_parts is None else self._head_parts[kind]

    def own_parts(self, kind: int) -> range:
        """The head parts of `kind` this handle reads (`split_reads`; every part within `every_head`)."""
        parts = self._parts(kind)
        return range(parts) if getattr(self._here, "every_head", False) else self._own.get(kind, range(parts))

    def own_heads(self, kind: int, own: range | None = None) -> slice:
        """The heads of `kind` this handle reads (`split_reads`), or those of parts `own`: every head, or its
        process's."""
        own, per_part = own or self.own_parts(kind), self.layout.heads(kind) // self._parts(kind)
        return slice(own.start * per_part, own.stop * per_part)

    @contextlib.contextmanager
    def every_head(self):
        """Within, the reads this thread issues read and check every head, whatever `split_reads` says this process
        reads (process 0 repacking the store for all: `specjax.engine.processes.reorder`)."""
        self._here.every_head = True
        try:
            yield
        finally:
            self._here.every_head = False

    @property
    def scheduler(self):
        """The disk's read queue (stores.scheduler): its measured rate, what waits in it."""
        return self._arrays.scheduler

    def read_runs(self, layer: int, kind: int, chunks, *, speculative: bool = False,
                  background: bool = False) -> list[Run]:
        """Read chunks of one layer and kind: runs of adjacent ids inside one segment are each one byte range of its
        extent (at most `max_read_bytes`, by default as large as the disk's scheduler allows), at the scheduler's
        priority `speculative` / `background` (stores.scheduler). Where the disk lets them (`KVArrays.shares_requests`:
        the page cache) the runs of one call share disk requests of up to that many bytes, read one after another by
        one disk thread; else each run is its own request. Each `Run.verified` resolves with its chunks and which of
        them passed their checksums, and is cancelled if the read was withdrawn unread. The runs are in chunk order;
        nothing here is done per chunk."""
        self._reads_started = True
        max_bytes = self.max_read_bytes or self._arrays.scheduler.max_read_bytes()
        max_chunks = max(1, max_bytes // self.layout.chunk_nbytes(kind))
        head_parts, own = self._parts(kind), self.own_parts(kind)
        runs = self.index.segment_runs(chunks, max_chunks)
        extents = self._extents(layer, kind, runs) if head_parts == 1 else {}
        out = []
        for request in _requests(runs, max_chunks if self._arrays.shares_requests(speculative) else 0):
            pieces, expected = [], []
            for seg, first, n in request:
                expected.append(seg.checksums[layer, kind, first - seg.first_chunk:first - seg.first_chunk + n,
                                              :self.layout.heads(kind)].copy())
                extent = extents.get(seg.seg_id)
                into = (None if extent is None else
                        extent.array[first - extent.first_chunk:first - extent.first_chunk + n])
                pieces.append((seg.first_chunk, seg.n_chunks, first, n, into))
            read = self._arrays.read_runs(layer, kind, pieces, speculative=speculative, background=background,
                                          head_parts=head_parts, own_parts=own)
            shared = DiskRequest(sum(n for _, _, n in request))
            runs_read = [Run(weakref.ref(read), first, n, request=shared, extent=extents.get(seg.seg_id))
                         for seg, first, n in request]
            read.future.add_done_callback(functools.partial(self._verify, runs_read, layer, kind, own, expected))
            out += runs_read
        return out

    def read_chunks(self, layer: int, kind: int, chunks, *, speculative: bool = False,
                    background: bool = False) -> list[ChunkRead]:
        """`read_runs`, one `ChunkRead` per chunk in the order of `chunks`: each `ChunkRead.future` resolves with its
        verified chunk `[heads, chunk_tokens, head_dim]`, or None if it is bad (counted), and is cancelled if its
        read was withdrawn unread."""
        chunks = [int(c) for c in chunks]
        order = {}
        for run in self.read_runs(layer, kind, chunks, speculative=speculative, background=background):
            for j in range(run.n_chunks):
                order[run.first_chunk + j] = ChunkRead(layer, kind, run.first_chunk + j, run)
        return [order[c] for c in chunks]

    def _extents(self, layer: int, kind: int, runs: list[tuple]) -> dict:
        """Per segment read, its landing buffer at (layer, kind) (`Extent`): the one an earlier read still alive
        landed in, else a new one spanning the whole segment. A buffer lives while a run (or a view of its chunks)
        does, then serves other reads (`stores.landing`). A segment whose layer and kind hold more than
        SEGMENT_BUFFER_BYTES gets a buffer per read call, spanning the chunks it reads: a guess of a few chunks is not
        to map and fault in a long prefix's whole layer."""
        lay = self.layout
        spans: dict = {}
        for seg, first, n in runs:
            lo, hi = spans.get(seg.seg_id, (seg, first, first + n))[1:]
            spans[seg.seg_id] = (seg, min(lo, first), max(hi, first + n))

        def new(lo: int, hi: int) -> Extent:
            return Extent(BUFFERS.empty((hi - lo, *lay.chunk_shape(kind)), lay.dtype_of(kind)), lo)

        out = {}
        for seg_id, (seg, lo, hi) in spans.items():
            if seg.n_chunks * lay.chunk_nbytes(kind) > SEGMENT_BUFFER_BYTES:
                out[seg_id] = new(lo, hi)
                continue
            key = (layer, kind, seg.first_chunk)
            with self._lock:
                extent = self._extents_alive.get(key)
            if extent is None:  # faulted in outside the lock; of two reads racing to make it, the first one's is kept
                extent = new(seg.first_chunk, seg.first_chunk + seg.n_chunks)
                with self._lock:
                    extent = self._extents_alive.setdefault(key, extent)
            out[seg_id] = extent
        return out

    def _verify(self, runs: list[Run], layer: int, kind: int, own: range, expected: list[np.ndarray], f) -> None:
        """Check each chunk of the runs one disk request landed against its heads' checksums before any is served
        (on the thread that landed it). Every `run.verified` resolves: a failure here makes a run's chunks misses,
        never a reader that waits forever."""
        if f.cancelled():  # withdrawn before it was read: nothing was read
            for run in runs:
                run.verified.cancel()
            return
        try:
            results = f.result()
        except Exception as e:  # noqa: BLE001 -- every run of the request unreadable
            results = [e] * len(runs)
        for run, want, result in zip(runs, expected, results):
            try:
                self._check_run(run, layer, kind, own, want, result)
            except BaseException as e:  # noqa: BLE001
                log.exception("chunks %d.. layer %d %s: checking the read failed", run.first_chunk, layer,
                              kvarray.KIND_NAMES[kind])
                if not run.verified.done():
                    self.metrics.add(bad_chunks=run.n_chunks)
                    run.verified.set_result((None, np.zeros(run.n_chunks, bool)))
                if not isinstance(e, Exception):
                    raise

    def _check_run(self, run: Run, layer: int, kind: int, own: range, expected: np.ndarray, arrays) -> None:
        """`arrays`: the run's chunks as read (head parts `own`), or the exception its read raised."""
        last = run.first_chunk + run.n_chunks - 1
        if isinstance(arrays, BaseException):  # unreadable chunks: misses, never an exception to serve
            log.warning("chunks %d..%d layer %d %s unreadable: %s", run.first_chunk, last, layer,
                        kvarray.KIND_NAMES[kind], arrays)
            self.metrics.add(bad_chunks=run.n_chunks)
            run.verified.set_result((None, np.zeros(run.n_chunks, bool)))
            return
        devices, heads = self._parts(kind), self.own_heads(kind, own)
        nbytes = arrays.nbytes // devices * len(own)
        self.metrics.add(disk_bytes=nbytes, probe_disk_bytes=nbytes if kvarray.base_of(kind) == kvarray.PROBE else 0,
                         chunks_read=run.n_chunks, read_requests=1)
        if devices > 1 and kind not in self._by_process:  # each device read its own heads' bytes of every chunk
            self.metrics.add_device_bytes([nbytes // len(own) if i in own else 0 for i in range(devices)])
        ok = (chunk_checksums(arrays[:, heads]) == expected[:, heads]).all(axis=1)
        if not ok.all():
            for j in np.flatnonzero(~ok):
                log.warning("chunk %d layer %d %s fails its checksum", run.first_chunk + j, layer,
                            kvarray.KIND_NAMES[kind])
            self.metrics.add(bad_chunks=int((~ok).sum()))
        run.verified.set_result((arrays, ok))

    def read_chunk(self, layer: int, kind: int, chunk: int, *, speculative: bool = False) -> concurrent.futures.Future:
        """Future of one verified chunk `[heads, chunk_tokens, head_dim]`, or of None if it is bad (counted)."""
        return self.read_chunks(layer, kind, [chunk], speculative=speculative)[0].future

    def expedite(self, run: Run) -> None:
        """A speculative read is needed now: the run joins the disk's demand queue (if it has not been issued)."""
        if (run_read := run.read) is not None:
            self._arrays.scheduler.expedite(run_read)

    def waiting(self, run: Run) -> bool:
        """Is the run's read still queued, not yet asked of the disk?"""
        run_read = run.read
        return run_read is not None and self._arrays.scheduler.waiting(run_read)

    def withdraw(self, run: Run, chunks: int = 1) -> None:
        """`chunks` more of a speculative run's chunks are no longer wanted; once none of its disk request's chunks
        is, a request not yet issued is dropped unread (its futures cancelled, nothing counted as read)."""
        with self._lock:
            run.request.unwanted += chunks
            done = run.request.unwanted >= run.request.n_chunks
        if done and (run_read := run.read) is not None:
            self._arrays.scheduler.withdraw(run_read)

    def read_locations(self, layer: int, kind: int, loc: Locations) -> concurrent.futures.Future:
        """Future of `Gathered` for the located positions: their chunks' runs read concurrently, each run's rows
        copied out in one indexing step once it is verified."""
        lay = self.layout
        runs = self.read_runs(layer, kind, distinct(loc.chunks))
        self.metrics.add(used_token_bytes=len(loc.chunks) * lay.token_nbytes(kind))

        def assemble(results):
            out = np.zeros((lay.heads(kind), len(loc.chunks), lay.width(kind)), lay.dtype_of(kind))
            ok = np.ones(len(loc.chunks), bool)
            for run, (arrays, good) in zip(runs, results):
                rows, index = run.rows(loc.chunks, good, ok)
                if len(rows):
                    out[:, rows] = arrays[index, :, loc.offsets[rows]].swapaxes(0, 1)
            return Gathered(out, ok)

        return when_all([run.verified for run in runs], assemble)

    def key_summaries(self, layer: int, chunks) -> Gathered:
        """The key summaries `[n, kv_heads, 2, head_dim]` (min, max; `stores.summaries`) of `chunks` at `layer`, from
        host memory; the keys of chunks this handle has no summary of are read (verified, counted) and summarised.
        `ok[i]` is False where that read found a bad chunk (its summary is zeros)."""
        chunks = [int(c) for c in chunks]
        expected = {c: self.index.expected_checksums(layer, kvarray.K, c) for c in set(chunks)}
        missing = []
        for c, e in expected.items():
            if e is None:
                raise KeyError(f"chunk {c} belongs to no segment of the store")
            if self.summaries.get(layer, c, e) is None:
                missing.append(c)
        bad = set()
        for read in self.read_chunks(layer, kvarray.K, sorted(missing)):
            keys = read.future.result()
            if keys is None:
                bad.add(read.chunk)
            else:
                self.summaries.put(layer, read.chunk, expected[read.chunk], keys)
        lay = self.layout
        out = np.zeros((len(chunks), lay.kv_heads, 2, lay.head_dim), lay.np_dtype)
        for i, c in enumerate(chunks):
            if c not in bad:
                out[i] = self.summaries.get(layer, c, expected[c])
        return Gathered(out, np.array([c not in bad for c in chunks], bool))

    def failing_nodes(self, match: "Match") -> list[int]:
        """The nodes on a match's path whose segment holds a chunk (of any layer or kind) that fails its checksum
        or cannot be read: every chunk of those segments is read and verified (counted as bad where it fails)."""
        lay = self.layout
        failing = []
        for node_id, seg in self.index.path_segments(match):
            reads = [self.read_chunk(layer, kind, c) for layer in range(lay.num_layers) for kind in lay.kinds()
                     for c in range(seg.first_chunk, seg.first_chunk + seg.n_chunks)]
            if any(read.result() is None for read in reads):
                failing.append(node_id)
        return failing
