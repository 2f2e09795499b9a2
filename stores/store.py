"""`KVStore`: persistent prefix KV on TensorStore, indexed by a radix tree, checksummed, crash-safe, shared.

Data model: a *segment* is an immutable run of tokens stored in consecutive chunks (possibly reordered, with a
mapping list back to original order); radix nodes point at ranges of segments. Chunk ids are unique across
every process sharing the store and never reused, so a cached chunk can never be confused with newer data;
segments that leave the tree are deleted once no open `Match` of the handle that removed them can read them.

Many processes (on many hosts, given a shared file system or an object store) may open one store: commits
merge instead of overwriting each other (stores/catalog.py), a handle adopts others' commits when it matches,
and orphan collection spares chunks that a live writer may still commit (stores/leases.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
import weakref

import numpy as np
import tensorstore as ts

from specjax.stores import kvarray, leases
from specjax.stores.catalog import Catalog, Change, Segment
from specjax.stores.errors import DiskFullError, StoreError
from specjax.stores.kvarray import K, KVArrays, Layout
from specjax.stores.manifest import ManifestIO, check_fingerprint
from specjax.stores.metrics import StoreMetrics
from specjax.stores.radix import PathStep, RadixTree
from specjax.stores.reads import ChunkRead, ChunkReads, Gathered, Locations, Run, _runs, when_all
from specjax.stores.summaries import KeySummaries
from specjax.stores.writer import PrefixWriter, SegmentWriter

log = logging.getLogger(__name__)

__all__ = ["ChunkRead", "Gathered", "KVStore", "Locations", "Match", "PrefixWriter", "Run", "Segment", "SegmentWriter",
           "kvstore_spec", "layout_from_fingerprint", "when_all"]


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


def layout_from_fingerprint(fingerprint: dict) -> Layout:
    missing = [k for k in ("num_layers", "kv_heads", "head_dim") if k not in fingerprint]
    if missing:
        raise ValueError(f"model fingerprint lacks {missing}; it needs num_layers, kv_heads, head_dim "
                         f"(and optionally dtype, chunk_tokens, probe_heads)")
    probe = fingerprint.get("probe_heads", 0)
    return Layout(num_layers=int(fingerprint["num_layers"]), kv_heads=int(fingerprint["kv_heads"]),
                  head_dim=int(fingerprint["head_dim"]),
                  probe_heads=len(probe) if isinstance(probe, (list, tuple)) else int(probe),
                  chunk_tokens=int(fingerprint.get("chunk_tokens", Layout.chunk_tokens)),
                  dtype=str(fingerprint.get("dtype", "float32")))


def kvstore_spec(location) -> dict:
    """A TensorStore kvstore spec from a local path, a kvstore URL ("gs://bucket/kv/", "file:///ssd/kv",
    "file:///nfs/kv|ocdbt") or a spec (dict or `ts.KvStore.Spec`)."""
    if isinstance(location, ts.KvStore.Spec):
        return location.to_json()
    if isinstance(location, bytes):
        location = location.decode()
    if isinstance(location, str) and "://" in location:
        return ts.KvStore.Spec(location).to_json()
    if isinstance(location, str) or hasattr(location, "__fspath__"):
        return {"driver": "file", "path": str(location)}
    return dict(location)


class KVStore(ChunkReads):
    """Prefix KV store: match, write, read by token position, importance feedback; see module docstring.

    `location`: a directory, a TensorStore kvstore spec or a kvstore URL (`kvstore_spec`). Many handles, in
    many processes, may share one store. `lease_s`: how long a writer on another host lives without a
    heartbeat before its uncommitted chunks may be collected. `refresh_s`: at most how often `match` checks
    for others' commits (default: every call on a local directory or in memory, one stat; 1 s elsewhere).
    `retire_grace_s`: how long chunks that left the tree (evicted, reordered away) stay on disk for matches
    other processes opened before; a segment still due when its handle closes is left to orphan collection.
    """

    def __init__(self, location, fingerprint: dict | None = None, *, create: bool = True,
                 read_only: bool = False, direct_io: bool = False, disk_bandwidth: float | None = None,
                 disk_capacity_bytes: int | None = None, context: ts.Context | None = None,
                 gc_orphans: bool = True, write_threads: int = 4, max_inflight_bytes: int | None = None,
                 max_read_bytes: int | None = None, lease_s: float = leases.LEASE_S, refresh_s: float | None = None,
                 retire_grace_s: float = 30.0):
        self.kvstore_spec = kvstore_spec(location)
        self.context = kvarray.make_context(direct_io, context)
        self.read_only = read_only
        self.disk_capacity_bytes = disk_capacity_bytes
        self.max_read_bytes = max_read_bytes  # None: as the read scheduler sizes reads for the disk
        self.metrics = StoreMetrics()
        self._head_parts: dict[int, int] | None = None  # ChunkReads.split_reads; None: whole chunk files
        self.summaries = KeySummaries()  # per-chunk key summaries in host memory (`key_summaries`)
        self._reads_started = False
        io = ManifestIO(self.kvstore_spec, self.context)
        self.where = io.where
        local = io.local_dir is not None or self.kvstore_spec.get("driver") == "memory"
        self.refresh_s = (0.0 if local else 1.0) if refresh_s is None else refresh_s
        self._refreshed_at = time.monotonic()
        self._lock = threading.RLock()
        self._cat = Catalog(io, self._lock, read_only=read_only, lease_s=lease_s)
        self._snapshots: collections.Counter = collections.Counter()   # generation -> open matches
        self._pinned: collections.Counter = collections.Counter()      # node id -> open matches
        self._free_callbacks: list = []
        self.retire_grace_s = retire_grace_s
        self._doomed: list[tuple[float, Segment]] = []  # (monotonic time due, retired segment to delete)
        self._closed = False
        arrays = functools.partial(KVArrays, self.kvstore_spec, context=self.context, disk_bandwidth=disk_bandwidth,
                                   max_inflight_bytes=max_inflight_bytes, direct_io=direct_io)
        body, stamp = io.read()
        self._arrays = None
        if body is None:
            if fingerprint is None or not create or read_only:
                raise StoreError(f"no KV store at {self.where}; open it with a model fingerprint to create one")
            layout = layout_from_fingerprint(fingerprint)
            self._arrays = arrays(layout)  # before a manifest names them
            body, stamp = io.create(Catalog.initial_body(self._full_fingerprint(fingerprint),
                                                         dataclasses.asdict(layout)))
        self.layout = Layout(**body["layout"])
        self.fingerprint = body["fingerprint"]
        if fingerprint is not None:
            check_fingerprint(self.fingerprint, self._full_fingerprint(fingerprint, self.layout), self.where)
        self._cat.adopt(body, stamp)
        if self._arrays is None:
            self._arrays = arrays(self.layout)
        self._pool = concurrent.futures.ThreadPoolExecutor(write_threads, thread_name_prefix="kv-write")
        if gc_orphans and not read_only:
            self.collect_orphans()

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

    # -- the shared metadata (stores/catalog.py) -----------------------------------------------

    @property
    def generation(self) -> int:
        """The manifest generation this handle serves."""
        return self._cat.generation

    @property
    def _segments(self) -> dict[int, Segment]:
        return self._cat.segments

    # -- what the store holds, as fsck reads it ----------------------------------------------------

    @property
    def tree(self) -> RadixTree:
        """The radix tree of the generation this handle serves (read it; change the store through its methods)."""
        return self._cat.tree

    def segments(self, *, referenced: bool = False) -> list[Segment]:
        """The segments of this generation; `referenced`: only those a tree node points at (not yet retired)."""
        with self._lock:
            return [s for s in self._segments.values() if s.refs > 0 or not referenced]

    def stored_chunk_ids(self) -> set[int]:
        """Chunk ids of every segment with any extent on disk, committed or not."""
        return self._arrays.stored_chunk_ids()

    def writer_ranges(self) -> list[tuple[int, int]]:
        """The chunk-id ranges [lo, hi) live writers have reserved (their inserts may still commit)."""
        return [tuple(r) for entry in self._cat.writers.values() for r in entry.get("ranges", [])]

    def refresh(self) -> bool:
        """Adopt what other handles committed since (at most every `refresh_s`); True if anything was new."""
        if self.refresh_s:
            now = time.monotonic()
            if now - self._refreshed_at < self.refresh_s:
                return False
            self._refreshed_at = now
        try:
            if not self._cat.refresh():
                return False
        except Exception as e:  # noqa: BLE001 -- this handle keeps serving the generation it has
            log.warning("could not check the KV store at %s for new commits: %s", self.where, e)
            return False
        self.collect_garbage()
        return True

    # -- snapshots, pins and deferred deletion -------------------------------------------------

    def match(self, tokens) -> Match:
        """Longest stored prefix of `tokens` (it may span several radix nodes, and include what other handles
        committed); close it when done."""
        tokens = np.asarray(tokens, np.int64)
        self.refresh()
        with self._lock:
            steps = self.tree.match(tokens)
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

    def collect_garbage(self) -> int:
        """Forget retired segments that no open match of this handle can read any more (caches drop them);
        returns how many. Those this handle's commits retired are deleted from disk `retire_grace_s` later, so
        that reads other processes began before the commit finish first."""
        with self._lock:
            free = self._cat.take_free(min(self._snapshots, default=None))
            now = time.monotonic()
            self._doomed += [(now + self.retire_grace_s, seg) for seg, ours in free if ours]
            due = [seg for t, seg in self._doomed if t <= now]
            self._doomed = [(t, seg) for t, seg in self._doomed if t > now]
        for seg, _ in free:
            self._delete_segment(seg, on_disk=False)
        for seg in due:
            self._delete_segment(seg, callbacks=False)
        return len(free)

    def on_free(self, callback) -> None:
        """Call `callback(chunk_ids)` when chunks are deleted (caches drop them)."""
        self._free_callbacks.append(callback)

    def off_free(self, callback) -> None:
        """Stop calling `callback` (given to `on_free`) when chunks are deleted."""
        self._free_callbacks.remove(callback)

    def _delete_segment(self, seg: Segment, on_disk: bool = True, callbacks: bool = True) -> None:
        chunk_ids = range(seg.first_chunk, seg.first_chunk + seg.n_chunks)
        for cb in self._free_callbacks if callbacks else ():
            cb(chunk_ids)
        if not on_disk:
            return
        try:
            self._arrays.delete_range(seg.first_chunk, seg.n_chunks)
        except Exception as e:  # noqa: BLE001 -- an undeleted orphan is harmless; reopening removes it
            log.warning("could not delete chunks %d..%d: %s", seg.first_chunk, seg.first_chunk + seg.n_chunks, e)

    def _discard_uncommitted(self, seg: Segment) -> None:
        with self._lock:
            if seg.committed:
                return  # published after all (the error came after the manifest was replaced)
            self._cat.forget(seg)
        self._delete_segment(seg)

    def collect_orphans(self) -> int:
        """Delete chunk files that no committed segment owns and no live writer can still commit (left by
        writers that died, or by removals whose deletion was cut short); returns how many."""
        listed = self._arrays.stored_chunk_ids()  # before the manifest the decision reads
        orphans = self._cat.collect_orphans(listed)
        for first, n in _runs(orphans, 1 << 20):
            self._arrays.delete_range(first, n)
        if orphans:
            log.info("removed %d orphan chunks from %s", len(orphans), self.where)
        return len(orphans)

    # -- writing -------------------------------------------------------------------------------

    def _chunk_bytes_all_layers(self) -> int:
        lay = self.layout
        return lay.num_layers * sum(lay.chunk_nbytes(kind) for kind in lay.kinds())

    def _live_chunks(self) -> int:
        with self._lock:
            return sum(s.n_chunks for s in self._segments.values() if not s.retired)

    @property
    def disk_bytes_used(self) -> int:
        return self._live_chunks() * self._chunk_bytes_all_layers()

    @property
    def summary_bytes(self) -> int:
        """Host memory the key summaries of every stored chunk take (`key_summaries`): 2 / chunk_tokens of K."""
        lay = self.layout
        return self._live_chunks() * lay.num_layers * lay.kv_heads * 2 * lay.head_dim * lay.np_dtype.itemsize

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
                self._cat.refresh()
                while self.disk_bytes_used + need > self.disk_capacity_bytes:
                    if not self._evict_one():
                        raise DiskFullError(f"the KV store at {self.where} is at its disk capacity of "
                                            f"{self.disk_capacity_bytes} bytes and every prefix is in use")
            first = self._cat.take_chunks(n_chunks)
            seg = Segment(first + 1, first, n_chunks, n_tokens,
                          np.zeros((lay.num_layers, len(lay.kinds()), n_chunks, lay.max_heads), np.uint32))
            self._cat.add(seg)
        return seg

    def _evict_one(self) -> bool:
        """Drop the least recently matched unpinned whole prefix tail (a leaf node); False if none."""
        def evict():
            leaves = [n for n in self.tree.leaves() if n.node_id not in self._pinned]
            if not leaves:
                return Change(False, publish=False)
            self.tree.remove_leaf(min(leaves, key=lambda n: n.last_access).node_id)
            return Change(True)

        return self._cat.transact(evict)

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

        def insert():
            try:
                node_id, created = self.tree.insert(writer.tokens, seg.seg_id, base_len)
            except KeyError:
                log.info("insert dropped: its base prefix was evicted meanwhile by another handle")
                return Change(None, publish=False)
            return Change(node_id, publish=node_id is not None or bool(created))

        node_id = self._cat.transact(insert, publishes=[seg])
        if node_id is None:
            self._discard_uncommitted(seg)
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

    def chunks_by_layer(self, match: Match) -> np.ndarray:
        """`[layers, match.length]`: the chunk id holding each matched position at every layer (`locate` of every
        position, for all layers at once)."""
        layers, c = self.layout.num_layers, self.layout.chunk_tokens
        out = np.empty((layers, match.length), np.int64)
        with self._lock:
            for step in match.steps:
                seg = self._segments[step.seg_id]
                original = step.seg_start + np.arange(step.length)
                stored = seg.mapping[:, original] if seg.mapping is not None and seg.mapping.ndim == 2 else \
                    seg.stored(original, None)
                out[:, step.prefix_start:step.prefix_start + step.length] = seg.first_chunk + stored // c
        return out

    def extent_of(self, layer: int, kind: int, chunk: int) -> tuple[str, int]:
        """(key under the store's kvstore, byte offset) of a chunk: its segment's extent of that layer and kind
        (stores.kvarray); fsck and tests locate bytes on disk with it."""
        with self._lock:
            seg = self._cat.segment_of(chunk)
            if seg is None:
                raise KeyError(f"chunk {chunk} belongs to no segment of the store")
            key, offset = self._arrays.extent_of(layer, kind, seg.first_chunk, seg.n_chunks, chunk)
        return "kv/" + key, offset

    def _expected_checksums(self, layer: int, kind: int, chunk: int) -> tuple[int, ...] | None:
        """The chunk's per-head checksums (as `manifest.chunk_checksums` gives them); None if no segment holds it."""
        with self._lock:
            seg = self._cat.segment_of(chunk)
            if seg is None:
                return None
            return tuple(seg.checksums[layer, kind, chunk - seg.first_chunk, :self.layout.heads(kind)].tolist())

    def key_summaries(self, layer: int, chunks) -> Gathered:
        """The key summaries `[n, kv_heads, 2, head_dim]` (min, max; `stores.summaries`) of `chunks` at `layer`, from
        host memory; the keys of chunks this handle has no summary of are read (verified, counted) and summarised.
        `ok[i]` is False where that read found a bad chunk (its summary is zeros)."""
        chunks = [int(c) for c in chunks]
        expected = {c: self._expected_checksums(layer, K, c) for c in set(chunks)}
        missing = []
        for c, e in expected.items():
            if e is None:
                raise KeyError(f"chunk {c} belongs to no segment of the store")
            if self.summaries.get(layer, c, e) is None:
                missing.append(c)
        bad = set()
        for read in self.read_chunks(layer, K, sorted(missing)):
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

    # -- repair --------------------------------------------------------------------------------

    def failing_nodes(self, match: Match) -> list[int]:
        """The nodes on a match's path whose segment holds a chunk (of any layer or kind) that fails its checksum
        or cannot be read: every chunk of those segments is read and verified (counted as bad where it fails)."""
        lay = self.layout
        failing = []
        for step in match.steps:
            with self._lock:
                seg = self._segments.get(step.seg_id)
            if seg is None:
                continue
            reads = [self.read_chunk(layer, kind, c) for layer in range(lay.num_layers) for kind in lay.kinds()
                     for c in range(seg.first_chunk, seg.first_chunk + seg.n_chunks)]
            if any(read.result() is None for read in reads):
                failing.append(step.node_id)
        return failing

    def drop_nodes(self, node_ids) -> list[np.ndarray]:
        """Remove these nodes and everything stored below them (their KV is damaged); their chunks are deleted
        once no open match reads them. Returns the token sequences that were stored through them (each removed
        leaf's whole prefix), for the caller to store anew."""
        node_ids = list(node_ids)

        def drop():
            lost = []
            for n in node_ids:
                if n in self.tree.nodes:
                    lost += [self.tree.prefix_tokens(leaf) for leaf in self.tree.leaves_below(n)]
                    self.tree.remove_subtree(n)
            return Change(lost, publish=bool(lost))

        if not node_ids:
            return []
        lost = self._cat.transact(drop)
        self.collect_garbage()
        return lost

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
            node = self.tree.nodes[node_id]
            seg = self._segments[node.seg_id]
            lo, hi = node.seg_start, node.seg_start + len(node)
            avg = seg.imp_sum[:, lo:hi] / np.maximum(seg.imp_count[lo:hi], 1)
            return avg if per_layer else avg.mean(axis=0)

    def node_observations(self, node_id: int) -> int:
        """How many requests reported importance for this node since it was last repacked."""
        with self._lock:
            node = self.tree.nodes[node_id]
            seg = self._segments[node.seg_id]
            counts = seg.imp_count[node.seg_start:node.seg_start + len(node)]
            return int(counts.max()) if len(counts) else 0

    def node_ids(self) -> list[int]:
        with self._lock:
            return [n for n in self.tree.nodes if n != RadixTree.ROOT]

    def node_view(self, node_id: int) -> tuple[int, int, int, Match]:
        """(seg_id, seg_start, n_tokens) of a node and a pinning snapshot of it (for copy-on-write)."""
        with self._lock:
            node = self.tree.nodes[node_id]
            steps = [PathStep(node_id, node.seg_id, node.seg_start, 0, len(node))]
            self._pin_snapshot(self.generation, [node_id])
            return node.seg_id, node.seg_start, len(node), Match(self, steps, node.tokens, self.generation)

    def new_segment_writer(self, n_tokens: int) -> SegmentWriter:
        return SegmentWriter(self, self._allocate(n_tokens))


    def swap_segment(self, node_id: int, expect: tuple[int, int, int], writer: SegmentWriter,
                     mapping: np.ndarray) -> bool:
        """Point `node_id` at the durable new segment if it still is `expect` in the newest generation (others'
        commits meanwhile are kept); atomic for readers."""
        new = writer.seg

        def swap():
            node = self.tree.nodes.get(node_id)
            if node is None or (node.seg_id, node.seg_start, len(node)) != expect:
                return Change(False, publish=False)  # split or evicted meanwhile: keep the old version
            old = self._segments[node.seg_id]
            lo, hi = node.seg_start, node.seg_start + len(node)
            new.mapping = mapping.astype(np.int32)
            new.imp_sum[:] = old.imp_sum[:, lo:hi]
            new.imp_count[:] = old.imp_count[lo:hi]
            node.seg_id, node.seg_start = new.seg_id, 0
            return Change(True)

        swapped = self._cat.transact(swap, publishes=[new])
        if swapped:
            self.collect_garbage()
        return swapped

    # -- lifetime ------------------------------------------------------------------------------

    def stats(self) -> dict:
        self.refresh()
        with self._lock:
            live = [s for s in self._segments.values() if s.refs > 0]
            return {"generation": self.generation, "nodes": len(self.tree.nodes) - 1, "segments": len(live),
                    "chunks": sum(s.n_chunks for s in live), "tokens": sum(len(n) for n in self.tree.nodes.values()),
                    "disk_bytes_used": self.disk_bytes_used, "commits": self._cat.commits,
                    "commit_conflicts": self._cat.conflicts}

    def close(self) -> None:
        """Finish queued writes and unregister this handle as a writer (its reserved, unused chunk ids lapse)."""
        self._pool.shutdown(wait=True)
        if not self._closed:
            self._closed = True
            self.collect_garbage()
            try:
                self._cat.release()
            except Exception as e:  # noqa: BLE001 -- a writer left registered is collected once this process ends
                log.warning("could not unregister from the KV store at %s: %s", self.where, e)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
