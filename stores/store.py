"""`KVStore`: persistent prefix KV on TensorStore, indexed by a radix tree, checksummed, crash-safe.

Data model: a *segment* is an immutable run of tokens stored in consecutive chunks (possibly reordered, with a
mapping list back to original order); radix nodes point at ranges of segments. Chunk ids only grow within a
process, so a cached chunk can never be confused with newer data; segments that leave the tree are deleted
once no open `Match` can still read them.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import dataclasses
import errno
import functools
import itertools
import logging
import threading
import weakref

import numpy as np
import tensorstore as ts

from specjax.stores import kvarray
from specjax.stores.errors import DiskFullError, StoreError
from specjax.stores.kvarray import K, PROBE, V, KVArrays, Layout
from specjax.stores.manifest import (FORMAT, ManifestIO, check_fingerprint, chunk_checksum, decode_array,
                                     encode_array)
from specjax.stores.metrics import StoreMetrics
from specjax.stores.radix import PathStep, RadixTree

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Segment:
    seg_id: int
    first_chunk: int
    n_chunks: int
    n_tokens: int
    checksums: np.ndarray             # uint32 [num_layers, kinds, n_chunks]
    # m[i] = stored position of original token i: None (identity), [n] (one order for every layer) or
    # [layers, n] (each layer its own order, as SPEC's per-layer PrefixKVLayer keeps it)
    mapping: np.ndarray | None = None
    refs: int = 0                      # radix nodes pointing into this segment
    committed: bool = False
    retired: bool = False
    imp_sum: np.ndarray | None = None  # accumulated importance per layer and original token [layers, n]
    imp_count: np.ndarray | None = None  # observations per original token [n]

    def __post_init__(self):
        if self.imp_sum is None:
            self.imp_sum = np.zeros((self.checksums.shape[0], self.n_tokens), np.float64)
            self.imp_count = np.zeros(self.n_tokens, np.int64)

    def stored(self, original: np.ndarray, layer: int | None) -> np.ndarray:
        if self.mapping is None:
            return original
        if self.mapping.ndim == 1:
            return self.mapping[original]
        if layer is None:
            raise ValueError(f"segment {self.seg_id} is reordered per layer: locate() needs the layer")
        return self.mapping[layer, original]


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


class Match:
    """The longest stored prefix of a request, pinned (readable, not evicted) until `close()`."""

    def __init__(self, store: "KVStore", steps: list[PathStep], tokens: np.ndarray, generation: int):
        self.steps = steps
        self.length = sum(s.length for s in steps)
        self.tokens = tokens[:self.length]
        self.generation = generation
        self._prefix_starts = np.array([s.prefix_start for s in steps], np.int64)
        self._release = weakref.finalize(self, store._release_snapshot, generation,
                                         tuple(s.node_id for s in steps))

    def node_ids(self) -> list[int]:
        return [s.node_id for s in self.steps]

    def close(self) -> None:
        self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _is_disk_full(e: BaseException) -> bool:
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left" in str(e) or "ENOSPC" in str(e)


def layout_from_fingerprint(fingerprint: dict) -> Layout:
    missing = [k for k in ("num_layers", "kv_heads", "head_dim") if k not in fingerprint]
    if missing:
        raise ValueError(f"model fingerprint lacks {missing}; it needs num_layers, kv_heads, head_dim "
                         f"(and optionally dtype, chunk_tokens, probe_heads)")
    probe = fingerprint.get("probe_heads", 0)
    return Layout(num_layers=int(fingerprint["num_layers"]), kv_heads=int(fingerprint["kv_heads"]),
                  head_dim=int(fingerprint["head_dim"]),
                  probe_heads=len(probe) if isinstance(probe, (list, tuple)) else int(probe),
                  chunk_tokens=int(fingerprint.get("chunk_tokens", 64)),
                  dtype=str(fingerprint.get("dtype", "float32")))


def when_all(futures: list, combine) -> concurrent.futures.Future:
    """A future of `combine(results)` once every future is done, without blocking a thread."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def finish():
        try:
            out.set_result(combine([f.result() for f in futures]))
        except BaseException as e:  # noqa: BLE001 -- delivered to the waiter
            out.set_exception(e)

    def one_done(_):
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            finish()

    if not futures:
        finish()
    for f in futures:
        f.add_done_callback(one_done)
    return out


class SegmentWriter:
    """Writes one new segment layer by layer (write-behind); `wait_durable()` before it may be referenced."""

    def __init__(self, store: "KVStore", seg: Segment):
        self.store, self.seg = store, seg
        self._layers: dict[int, concurrent.futures.Future] = {}
        self._closed = False

    @property
    def n_tokens(self) -> int:
        return self.seg.n_tokens

    def write_layer(self, layer: int, k, v, probe_k=None) -> concurrent.futures.Future:
        """Queue one layer's K, V `[kv_heads, n, head_dim]` and probe keys `[probe_heads, n, head_dim]`."""
        lay = self.store.layout
        if not 0 <= layer < lay.num_layers:
            raise ValueError(f"layer {layer} outside 0..{lay.num_layers - 1}")
        if layer in self._layers:
            raise ValueError(f"layer {layer} already written")
        arrays = {K: k, V: v}
        if lay.probe_heads:
            if probe_k is None:
                raise ValueError("this store keeps probe keys: pass probe_k [probe_heads, n, head_dim]")
            arrays[PROBE] = probe_k
        for kind, a in arrays.items():
            want = (lay.heads(kind), self.seg.n_tokens, lay.head_dim)
            if tuple(a.shape) != want:
                raise ValueError(f"{kvarray.KIND_NAMES[kind]} of layer {layer} has shape {tuple(a.shape)}, "
                                 f"expected {want}")
        future = self.store._pool.submit(self._write_layer_now, layer, arrays)
        self._layers[layer] = future
        return future

    def _write_layer_now(self, layer: int, arrays: dict) -> None:
        lay, seg = self.store.layout, self.seg
        padded_tokens = seg.n_chunks * lay.chunk_tokens
        pending = []
        try:
            for kind, a in arrays.items():
                data = np.zeros((lay.heads(kind), padded_tokens, lay.head_dim), lay.np_dtype)
                data[:, :seg.n_tokens] = np.asarray(a)
                for j in range(seg.n_chunks):
                    chunk = data[:, j * lay.chunk_tokens:(j + 1) * lay.chunk_tokens]
                    seg.checksums[layer, kind, j] = chunk_checksum(chunk)
                pending.append(self.store._arrays.write_range(layer, kind, seg.first_chunk, data))
            for w in pending:
                w.result()  # resolves once the chunk files are written and synced
        except Exception as e:  # noqa: BLE001 -- mapped to a clear store error
            if _is_disk_full(e):
                raise DiskFullError(f"disk full while writing the KV store at {self.store.where}; "
                                    f"free space or set a smaller disk capacity (reads still work)") from None
            raise StoreError(f"writing layer {layer} to the KV store at {self.store.where} failed: {e}") from e
        self.store.metrics.add(disk_bytes_written=sum(a.nbytes for a in arrays.values()))

    def wait_durable(self) -> None:
        missing = sorted(set(range(self.store.layout.num_layers)) - set(self._layers))
        if missing:
            raise StoreError(f"cannot commit: layers {missing} were never written")
        for layer in sorted(self._layers):
            self._layers[layer].result()

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            for f in self._layers.values():
                f.cancel()
            concurrent.futures.wait(list(self._layers.values()))
            self.store._discard_uncommitted(self.seg)


class PrefixWriter(SegmentWriter):
    """New prefix tokens appended below a matched prefix; `commit()` makes them visible and durable."""

    def __init__(self, store: "KVStore", seg: Segment, tokens: np.ndarray, base: Match | None):
        super().__init__(store, seg)
        self.tokens = tokens
        self.base = base

    def commit(self) -> int | None:
        """Wait for every layer to be durable, then atomically publish; returns the new node id (None if the
        tokens were meanwhile stored by another insert)."""
        if self._closed:
            raise StoreError("this insert was already committed or aborted")
        try:
            self.wait_durable()
            node_id = self.store._publish_insert(self)
        except BaseException:
            self.abort()
            raise
        finally:
            if self.base is not None:
                self.base.close()
        self._closed = True
        return node_id

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *rest):
        if exc_type is not None:
            self.abort()


class KVStore:
    """Prefix KV store: match, write, read by token position, importance feedback; see module docstring."""

    def __init__(self, location, fingerprint: dict | None = None, *, create: bool = True,
                 read_only: bool = False, direct_io: bool = False, disk_bandwidth: float | None = None,
                 disk_capacity_bytes: int | None = None, context: ts.Context | None = None,
                 gc_orphans: bool = True, write_threads: int = 4, max_inflight_bytes: int | None = None,
                 max_read_bytes: int | None = None):
        self.kvstore_spec = {"driver": "file", "path": str(location)} if isinstance(location, (str, bytes)) \
            or hasattr(location, "__fspath__") else dict(location)
        self.context = kvarray.make_context(direct_io, context)
        self.read_only = read_only
        self.disk_capacity_bytes = disk_capacity_bytes
        self.max_read_bytes = max_read_bytes  # None: as the read scheduler sizes reads for the disk
        self.metrics = StoreMetrics()
        self._manifest = ManifestIO(self.kvstore_spec, self.context)
        self.where = self._manifest.where
        self._lock = threading.RLock()
        self._snapshots: collections.Counter = collections.Counter()   # generation -> open matches
        self._pinned: collections.Counter = collections.Counter()      # node id -> open matches
        self._retired: list[tuple[int, Segment]] = []                  # (first generation without it, seg)
        self._seg_ids = itertools.count(1)
        self._free_callbacks: list = []
        self._seg_firsts: list[int] = []      # sorted first chunk ids, to find a chunk's segment
        self._seg_by_first: dict[int, int] = {}
        body = self._manifest.read()
        if body is None:
            if fingerprint is None or not create or read_only:
                raise StoreError(f"no KV store at {self.where}; open it with a model fingerprint to create one")
            self.layout = layout_from_fingerprint(fingerprint)
            self.fingerprint = self._full_fingerprint(fingerprint)
            self._tree, self._segments, self.generation, self._next_chunk = RadixTree(), {}, 0, 0
            self._arrays = KVArrays(self.kvstore_spec, self.layout, self.context, create=True,
                                    disk_bandwidth=disk_bandwidth, max_inflight_bytes=max_inflight_bytes)
            self._commit_manifest()
        else:
            stored_layout = Layout(**body["layout"])
            self.fingerprint = body["fingerprint"]
            if fingerprint is not None:
                check_fingerprint(self.fingerprint, self._full_fingerprint(fingerprint, stored_layout), self.where)
            self.layout = stored_layout
            self._load(body)
            self._arrays = KVArrays(self.kvstore_spec, self.layout, self.context, create=False,
                                    disk_bandwidth=disk_bandwidth, max_inflight_bytes=max_inflight_bytes)
            if gc_orphans and not read_only:
                self._delete_orphans()
        self._pool = concurrent.futures.ThreadPoolExecutor(write_threads, thread_name_prefix="kv-write")

    @classmethod
    def open(cls, location, fingerprint: dict | None = None, **kwargs) -> "KVStore":
        return cls(location, fingerprint, **kwargs)

    def _full_fingerprint(self, fingerprint: dict, layout: Layout | None = None) -> dict:
        """The caller's fingerprint plus the layout fields it left to defaults, so both sides compare fully."""
        layout = layout_from_fingerprint(fingerprint) if layout is None else layout
        full = dict(fingerprint)
        full.setdefault("chunk_tokens", layout.chunk_tokens)
        full.setdefault("dtype", layout.dtype)
        full.setdefault("probe_heads", layout.probe_heads)
        return full

    # -- manifest -----------------------------------------------------------------------------

    def _load(self, body: dict) -> None:
        self.generation = body["generation"]
        self._next_chunk = body["next_chunk"]
        self._segments = {}
        for s in body["segments"]:
            seg = Segment(s["id"], s["first_chunk"], s["n_chunks"], s["n_tokens"], decode_array(s["checksums"]),
                          decode_array(s["mapping"]), committed=True)
            self._segments[seg.seg_id] = seg
            self._index(seg)
        self._tree = RadixTree.from_records(
            [dict(r, tokens=decode_array(r["tokens"])) for r in body["nodes"]])
        for node in self._tree.nodes.values():
            if node.seg_id is not None:
                self._segments[node.seg_id].refs += 1
        self._seg_ids = itertools.count(max(self._segments, default=0) + 1)

    def _body(self) -> dict:
        segments = [{"id": s.seg_id, "first_chunk": s.first_chunk, "n_chunks": s.n_chunks, "n_tokens": s.n_tokens,
                     "checksums": encode_array(s.checksums), "mapping": encode_array(s.mapping)}
                    for s in self._segments.values() if s.refs > 0]
        nodes = [dict(r, tokens=encode_array(r["tokens"])) for r in self._tree.to_records()]
        return {"format": FORMAT, "generation": self.generation, "fingerprint": self.fingerprint,
                "layout": dataclasses.asdict(self.layout), "next_chunk": self._next_chunk,
                "segments": segments, "nodes": nodes}

    def _commit_manifest(self) -> None:
        """Publish the in-memory tree as the next generation (caller holds the lock, data already durable)."""
        if self.read_only:
            raise StoreError(f"the KV store at {self.where} was opened read-only")
        self.generation += 1
        try:
            self._manifest.write(self._body())
        except OSError as e:
            self.generation -= 1
            if _is_disk_full(e):
                raise DiskFullError(f"disk full while committing the manifest of the KV store at {self.where}; "
                                    f"free space (reads still work)") from None
            raise

    # -- snapshots, pins and deferred deletion -------------------------------------------------

    def match(self, tokens) -> Match:
        """Longest stored prefix of `tokens` (it may span several radix nodes); close it when done."""
        tokens = np.asarray(tokens, np.int64)
        with self._lock:
            steps = self._tree.match(tokens)
            self._pin_snapshot(self.generation, [s.node_id for s in steps])
            return Match(self, steps, tokens, self.generation)

    def join(self, matches) -> Match:
        """One match over several matched sequences laid end to end (text chunks cached independently and read
        as one context, CacheBlend): its position p is position p - start of the part holding it. It pins what
        it reads, as old a snapshot as its oldest part, until closed, independently of the parts."""
        steps, tokens, start = [], [], 0
        for m in matches:
            steps += [dataclasses.replace(s, prefix_start=s.prefix_start + start) for s in m.steps]
            tokens.append(m.tokens)
            start += m.length
        with self._lock:
            generation = min((m.generation for m in matches), default=self.generation)
            self._pin_snapshot(generation, [s.node_id for s in steps])
        return Match(self, steps, np.concatenate(tokens) if tokens else np.zeros(0, np.int64), generation)

    def _pin_snapshot(self, generation: int, node_ids) -> None:
        """Keep a generation's manifest and these nodes' chunks alive until `_release_snapshot` (lock held)."""
        self._snapshots[generation] += 1
        for n in node_ids:
            self._pinned[n] += 1

    def _release_snapshot(self, generation: int, node_ids: tuple) -> None:
        with self._lock:
            self._snapshots[generation] -= 1
            if self._snapshots[generation] <= 0:
                del self._snapshots[generation]
            for n in node_ids:
                self._pinned[n] -= 1
                if self._pinned[n] <= 0:
                    del self._pinned[n]

    def _retire(self, seg: Segment) -> None:
        """`seg` left the tree in the generation just committed; delete once older snapshots are closed."""
        seg.retired = True
        self._retired.append((self.generation, seg))

    def collect_garbage(self) -> int:
        """Delete retired segments that no open match can read any more; returns how many."""
        with self._lock:
            oldest = min(self._snapshots, default=None)
            free = [seg for gen, seg in self._retired if oldest is None or oldest >= gen]
            self._retired = [(g, s) for g, s in self._retired if s not in free]
            for seg in free:
                self._segments.pop(seg.seg_id, None)
                self._unindex(seg)
        for seg in free:
            self._delete_segment(seg)
        return len(free)

    def on_free(self, callback) -> None:
        """Call `callback(chunk_ids)` when chunks are deleted (caches drop them)."""
        self._free_callbacks.append(callback)

    def _delete_segment(self, seg: Segment) -> None:
        chunk_ids = range(seg.first_chunk, seg.first_chunk + seg.n_chunks)
        for cb in self._free_callbacks:
            cb(chunk_ids)
        try:
            self._arrays.delete_range(seg.first_chunk, seg.n_chunks)
        except Exception as e:  # noqa: BLE001 -- an undeleted orphan is harmless; reopening removes it
            log.warning("could not delete chunks %d..%d: %s", seg.first_chunk, seg.first_chunk + seg.n_chunks, e)

    def _discard_uncommitted(self, seg: Segment) -> None:
        with self._lock:
            self._segments.pop(seg.seg_id, None)
            self._unindex(seg)
        self._delete_segment(seg)

    def _delete_orphans(self) -> None:
        """Remove chunk files no committed segment owns (left by inserts a crash interrupted)."""
        owned = set()
        for seg in self._segments.values():
            owned.update(range(seg.first_chunk, seg.first_chunk + seg.n_chunks))
        root = ts.KvStore.open(self.kvstore_spec, context=self.context).result()
        orphans = sorted(self._arrays.stored_chunk_ids(root) - owned)
        for chunk in orphans:
            self._arrays.delete_range(chunk, 1)
        if orphans:
            log.info("removed %d orphan chunks from %s", len(orphans), self.where)
            self._next_chunk = max(self._next_chunk, orphans[-1] + 1)

    # -- writing -------------------------------------------------------------------------------

    def _chunk_bytes_all_layers(self) -> int:
        lay = self.layout
        return lay.num_layers * sum(lay.chunk_nbytes(kind) for kind in lay.kinds())

    @property
    def disk_bytes_used(self) -> int:
        with self._lock:
            chunks = sum(s.n_chunks for s in self._segments.values() if not s.retired)
        return chunks * self._chunk_bytes_all_layers()

    def _allocate(self, n_tokens: int) -> Segment:
        if self.read_only:
            raise StoreError(f"the KV store at {self.where} was opened read-only")
        lay = self.layout
        n_chunks = -(-n_tokens // lay.chunk_tokens)
        need = n_chunks * self._chunk_bytes_all_layers()
        with self._lock:
            if self.disk_capacity_bytes is not None:
                if need > self.disk_capacity_bytes:
                    raise DiskFullError(f"{n_tokens} tokens need {need} bytes, more than the store's disk "
                                        f"capacity of {self.disk_capacity_bytes} bytes; raise the capacity")
                while self.disk_bytes_used + need > self.disk_capacity_bytes:
                    if not self._evict_one():
                        raise DiskFullError(f"the KV store at {self.where} is at its disk capacity of "
                                            f"{self.disk_capacity_bytes} bytes and every prefix is in use")
            seg = Segment(next(self._seg_ids), self._next_chunk, n_chunks, n_tokens,
                          np.zeros((lay.num_layers, len(lay.kinds()), n_chunks), np.uint32))
            self._next_chunk += n_chunks
            self._segments[seg.seg_id] = seg
            self._index(seg)
        return seg

    def _evict_one(self) -> bool:
        """Drop the least recently matched unpinned whole prefix tail (a leaf node); False if none."""
        leaves = [n for n in self._tree.leaves() if n.node_id not in self._pinned]
        if not leaves:
            return False
        victim = min(leaves, key=lambda n: n.last_access)
        self._tree.remove_leaf(victim.node_id)
        seg = self._segments[victim.seg_id]
        seg.refs -= 1
        self._commit_manifest()
        if seg.refs == 0:
            self._retire(seg)
        return True

    def begin_insert(self, tokens, base: Match | None = None) -> PrefixWriter:
        """Start storing `tokens[base.length:]` below the matched `base` (the writer owns and closes `base`).

        Write every layer with `writer.write_layer(...)`, then `writer.commit()`.
        """
        tokens = np.asarray(tokens, np.int64)
        base_len = base.length if base is not None else 0
        if base is not None and not np.array_equal(base.tokens, tokens[:base_len]):
            raise ValueError("base match is not a prefix of the tokens to insert")
        if base_len >= len(tokens):
            raise ValueError("nothing to insert: every token is already in the matched prefix")
        seg = self._allocate(len(tokens) - base_len)
        return PrefixWriter(self, seg, tokens, base)

    def insert(self, tokens, layers_kv, base: Match | None = None) -> int | None:
        """Synchronous convenience: `layers_kv[layer] = (k, v, probe_k)` for the new tokens."""
        writer = self.begin_insert(tokens, base)
        with writer:
            for layer, kv in enumerate(layers_kv):
                writer.write_layer(layer, *kv)
            return writer.commit()

    def _publish_insert(self, writer: PrefixWriter) -> int | None:
        seg, base_len = writer.seg, writer.base.length if writer.base is not None else 0
        with self._lock:
            node_id, created = self._tree.insert(writer.tokens, seg.seg_id, base_len)
            for split_id in created:
                self._segments[self._tree.nodes[split_id].seg_id].refs += 1
            if node_id is None:
                self._retire(seg)
            else:
                seg.refs += 1
                seg.committed = True
            try:
                self._commit_manifest()
            except BaseException:
                if node_id is not None:
                    self._tree.remove_leaf(node_id)
                    seg.refs -= 1
                raise
        self.collect_garbage()
        return node_id

    # -- reading -------------------------------------------------------------------------------

    def locate(self, match: Match, positions, layer: int | None = None) -> Locations:
        """Chunk id and offset of each original prefix position of `layer` (through each node's mapping list;
        `layer` may be None only while no node on the path is reordered per layer)."""
        pos = np.asarray(positions, np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= match.length):
            raise IndexError(f"positions must lie in [0, {match.length}) of the matched prefix")
        step_of = np.searchsorted(match._prefix_starts, pos, side="right") - 1
        chunks = np.empty(pos.shape, np.int64)
        offsets = np.empty(pos.shape, np.int64)
        c = self.layout.chunk_tokens
        with self._lock:
            for i in np.unique(step_of):
                step = match.steps[i]
                sel = step_of == i
                seg = self._segments[step.seg_id]
                stored = seg.stored(step.seg_start + pos[sel] - step.prefix_start, layer)
                chunks[sel] = seg.first_chunk + stored // c
                offsets[sel] = stored % c
        return Locations(chunks, offsets)

    def _expected_checksum(self, layer: int, kind: int, chunk: int) -> int | None:
        with self._lock:
            i = bisect.bisect_right(self._seg_firsts, chunk) - 1
            if i < 0:
                return None
            seg = self._segments.get(self._seg_by_first[self._seg_firsts[i]])
            if seg is None or chunk >= seg.first_chunk + seg.n_chunks:
                return None
            return int(seg.checksums[layer, kind, chunk - seg.first_chunk])

    def _index(self, seg: Segment) -> None:
        bisect.insort(self._seg_firsts, seg.first_chunk)
        self._seg_by_first[seg.first_chunk] = seg.seg_id

    def _unindex(self, seg: Segment) -> None:
        if self._seg_by_first.pop(seg.first_chunk, None) is not None:
            self._seg_firsts.remove(seg.first_chunk)

    @property
    def scheduler(self):
        """The disk's read queue (stores.scheduler): its measured rate, what waits in it."""
        return self._arrays.scheduler

    def read_chunks(self, layer: int, kind: int, chunks, *, speculative: bool = False) -> list[ChunkRead]:
        """Read chunks of one layer and kind: runs of adjacent ids go to the disk as one read (at most
        `max_read_bytes`, by default as large as the disk's scheduler allows). Each `ChunkRead.future` resolves
        with its verified chunk `[heads, chunk_tokens, head_dim]`, or None if it is bad (counted), and is
        cancelled if its read was withdrawn unread."""
        chunks = [int(c) for c in chunks]
        expected = {c: self._expected_checksum(layer, kind, c) for c in chunks}
        for c, e in expected.items():
            if e is None:
                raise KeyError(f"chunk {c} belongs to no segment of the store")
        reads = []
        max_bytes = self.max_read_bytes or self._arrays.scheduler.max_read_bytes()
        for first, n in _runs(chunks, max(1, max_bytes // self.layout.chunk_nbytes(kind))):
            run = _Run(self._arrays.read_run(layer, kind, first, n, speculative=speculative), n)
            parts = [ChunkRead(layer, kind, first + j, run) for j in range(n)]
            run.read.future.add_done_callback(functools.partial(self._verify, parts, expected))
            reads += parts
        order = {r.chunk: r for r in reads}
        return [order[c] for c in chunks]

    def _verify(self, parts: list, expected: dict, f) -> None:
        """Split a landed run into its chunks, each checked against its checksum before it is served."""
        if f.cancelled():  # withdrawn before it was read: nothing was read
            for part in parts:
                part.future.cancel()
            return
        first = parts[0]
        try:
            array = f.result()
        except Exception as e:  # noqa: BLE001 -- unreadable chunks: misses, never an exception to serve
            log.warning("chunks %d..%d layer %d %s unreadable: %s", first.chunk, parts[-1].chunk, first.layer,
                        kvarray.KIND_NAMES[first.kind], e)
            self.metrics.add(bad_chunks=len(parts))
            for part in parts:
                part.future.set_result(None)
            return
        self.metrics.add(disk_bytes=array.nbytes, chunks_read=len(parts), read_requests=1)
        c = self.layout.chunk_tokens
        for j, part in enumerate(parts):
            chunk = array if len(parts) == 1 else np.ascontiguousarray(array[:, j * c:(j + 1) * c])
            if chunk_checksum(chunk) != expected[part.chunk]:
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

    def read(self, match: Match, layer: int, kind: int, positions=None) -> concurrent.futures.Future:
        """Future of `Gathered` vectors of `positions` (original prefix order; default all) of one layer."""
        positions = np.arange(match.length) if positions is None else positions
        return self.read_locations(layer, kind, self.locate(match, positions, layer))

    # -- importance feedback and reordering ----------------------------------------------------

    def record_importance(self, match: Match, importance, positions=None) -> None:
        """Add one request's importance of matched tokens: `[layers, n]`, or `[n]` counted for every layer.

        Every matched token counts one observation; `positions` (default: all) receive `importance`.
        """
        imp = np.asarray(importance, np.float64)
        imp = np.broadcast_to(imp, (self.layout.num_layers, imp.shape[-1])) if imp.ndim == 1 else imp
        pos = np.arange(match.length) if positions is None else np.asarray(positions, np.int64)
        if imp.shape != (self.layout.num_layers,) + pos.shape:
            raise ValueError(f"importance has shape {imp.shape} for {self.layout.num_layers} layers and "
                             f"{pos.shape[0]} positions")
        with self._lock:
            for step in match.steps:
                seg = self._segments.get(step.seg_id)
                if seg is None:
                    continue
                seg.imp_count[step.seg_start:step.seg_start + step.length] += 1
                sel = (pos >= step.prefix_start) & (pos < step.prefix_start + step.length)
                np.add.at(seg.imp_sum, (slice(None), step.seg_start + pos[sel] - step.prefix_start), imp[:, sel])

    def node_importance(self, node_id: int, per_layer: bool = False) -> np.ndarray:
        """Average observed importance of each token of a node (0 where never observed): `[n]` averaged over
        layers, or `[layers, n]` with `per_layer`."""
        with self._lock:
            node = self._tree.nodes[node_id]
            seg = self._segments[node.seg_id]
            lo, hi = node.seg_start, node.seg_start + len(node)
            avg = seg.imp_sum[:, lo:hi] / np.maximum(seg.imp_count[lo:hi], 1)
            return avg if per_layer else avg.mean(axis=0)

    def node_observations(self, node_id: int) -> int:
        """How many requests reported importance for this node since it was last repacked."""
        with self._lock:
            node = self._tree.nodes[node_id]
            seg = self._segments[node.seg_id]
            counts = seg.imp_count[node.seg_start:node.seg_start + len(node)]
            return int(counts.max()) if len(counts) else 0

    def node_ids(self) -> list[int]:
        with self._lock:
            return [n for n in self._tree.nodes if n != RadixTree.ROOT]

    def node_view(self, node_id: int) -> tuple[int, int, int, Match]:
        """(seg_id, seg_start, n_tokens) of a node and a pinning snapshot of it (for copy-on-write)."""
        with self._lock:
            node = self._tree.nodes[node_id]
            steps = [PathStep(node_id, node.seg_id, node.seg_start, 0, len(node))]
            self._pin_snapshot(self.generation, [node_id])
            return node.seg_id, node.seg_start, len(node), Match(self, steps, node.tokens, self.generation)

    def new_segment_writer(self, n_tokens: int) -> SegmentWriter:
        return SegmentWriter(self, self._allocate(n_tokens))

    def swap_segment(self, node_id: int, expect: tuple[int, int, int], writer: SegmentWriter,
                     mapping: np.ndarray) -> bool:
        """Point `node_id` at the durable new segment if it still is `expect`; atomic for readers."""
        new = writer.seg
        with self._lock:
            node = self._tree.nodes.get(node_id)
            if node is None or (node.seg_id, node.seg_start, len(node)) != expect:
                return False  # the node was split or evicted meanwhile: keep the old version
            old = self._segments[node.seg_id]
            lo, hi = node.seg_start, node.seg_start + len(node)
            new.mapping = mapping.astype(np.int32)
            new.imp_sum[:] = old.imp_sum[:, lo:hi]
            new.imp_count[:] = old.imp_count[lo:hi]
            node.seg_id, node.seg_start = new.seg_id, 0
            new.refs, new.committed = 1, True
            old.refs -= 1
            try:
                self._commit_manifest()
            except BaseException:
                node.seg_id, node.seg_start = old.seg_id, lo
                old.refs += 1
                new.refs = 0
                raise
            if old.refs == 0:
                self._retire(old)
        self.collect_garbage()
        return True

    # -- lifetime ------------------------------------------------------------------------------

    def stats(self) -> dict:
        with self._lock:
            live = [s for s in self._segments.values() if s.refs > 0]
            return {"generation": self.generation, "nodes": len(self._tree.nodes) - 1, "segments": len(live),
                    "chunks": sum(s.n_chunks for s in live), "tokens": sum(len(n) for n in self._tree.nodes.values()),
                    "disk_bytes_used": self.disk_bytes_used}

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
