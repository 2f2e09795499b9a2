"""`StoreIndex`: what a KV store holds and who may read it, for one handle: the shared catalog (segments, the radix
tree, commits merged with other processes': stores/catalog.py), the matches open on it, and when chunks that left
the tree may be deleted.

A segment is an immutable run of tokens stored in consecutive chunks (possibly reordered, with a mapping list back
to original order); radix nodes point at ranges of segments. Chunk ids are unique across every process sharing the
store and never reused, so a cached chunk can never be confused with newer data; segments that leave the tree are
deleted once no open `Match` of the handle that removed them can read them. The index reads and writes no KV: the
store's `ChunkReader` and `StoreWriter` do, asking it where chunks are and what they must hash to
(`segment_runs`, `expected_checksums`), for a new segment (`allocate`) and to publish it (`publish_insert`)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

import numpy as np

from specjax.idsets import consecutive_runs
from specjax.stores import leases
from specjax.stores.catalog import Catalog, Change, Segment
from specjax.stores.errors import DiskFullError, StoreError
from specjax.stores.kvarray import KVArrays, Layout
from specjax.stores.locations import Locations
from specjax.stores.manifest import ManifestIO, check_fingerprint, full_fingerprint, layout_from_fingerprint
from specjax.stores.match import Match
from specjax.stores.radix import PathStep, RadixTree

log = logging.getLogger(__name__)


class StoreIndex:
    """One handle's view of a store's metadata, and the chunk data's lifetime (see the module docstring).

    `make_arrays(layout)`: the store's chunk data (`KVArrays`), made once the layout is known (from the manifest, or
    from `fingerprint` when the store is created); the index deletes from it what left the tree and what no commit
    owns. `lease_s`, `refresh_s`, `retire_grace_s`, `disk_capacity_bytes`: as `KVStore` documents them."""

    def __init__(self, io: ManifestIO, make_arrays, fingerprint: dict | None = None, *, create: bool = True,
                 read_only: bool = False, disk_capacity_bytes: int | None = None, lease_s: float = leases.LEASE_S,
                 refresh_s: float | None = None, retire_grace_s: float = 30.0, local: bool = True):
        self.where = io.where
        self.read_only = read_only
        self.disk_capacity_bytes = disk_capacity_bytes
        self.refresh_s = (0.0 if local else 1.0) if refresh_s is None else refresh_s
        self._refreshed_at = time.monotonic()
        self.lock = threading.RLock()
        # the shared metadata (stores/catalog.py); read it, and change the store through the methods below
        self.catalog = Catalog(io, self.lock, read_only=read_only, lease_s=lease_s)
        self._snapshots: collections.Counter = collections.Counter()   # generation -> open matches
        self._pinned: collections.Counter = collections.Counter()      # node id -> open matches
        self._free_callbacks: list = []
        self.retire_grace_s = retire_grace_s
        self._doomed: list[tuple[float, Segment]] = []  # (monotonic time due, retired segment to delete)
        body, stamp = io.read()
        self.arrays: KVArrays | None = None
        if body is None:
            if fingerprint is None or not create or read_only:
                raise StoreError(f"no KV store at {self.where}; open it with a model fingerprint to create one")
            layout = layout_from_fingerprint(fingerprint)
            self.arrays = make_arrays(layout)  # before a manifest names them
            body, stamp = io.create(Catalog.initial_body(full_fingerprint(fingerprint), dataclasses.asdict(layout)))
        self.layout = Layout(**body["layout"])
        self.fingerprint = body["fingerprint"]
        if fingerprint is not None:
            check_fingerprint(self.fingerprint, full_fingerprint(fingerprint, self.layout), self.where)
        self.catalog.adopt(body, stamp)
        if self.arrays is None:
            self.arrays = make_arrays(self.layout)

    # -- the shared metadata (stores/catalog.py) -----------------------------------------------

    @property
    def generation(self) -> int:
        """The manifest generation this handle serves."""
        return self.catalog.generation

    @property
    def tree(self) -> RadixTree:
        """The radix tree of the generation this handle serves (read it; change the store through its methods)."""
        return self.catalog.tree

    def segments(self, *, referenced: bool = False) -> list[Segment]:
        """The segments of this generation; `referenced`: only those a tree node points at (not yet retired)."""
        with self.lock:
            return [s for s in self.catalog.segments.values() if s.refs > 0 or not referenced]

    def segment_of(self, chunk: int) -> Segment | None:
        """The segment holding `chunk` (None: none does)."""
        with self.lock:
            return self.catalog.segment_of(chunk)

    def segment_runs(self, chunks, max_chunks: int) -> list[tuple[Segment, int, int]]:
        """(segment, first chunk, count): runs of adjacent chunk ids, each inside one segment and at most
        `max_chunks` long; KeyError for a chunk no segment holds."""
        out = []
        with self.lock:
            for first, n in consecutive_runs(chunks, 1 << 62):
                while n:
                    seg = self.catalog.segment_of(first)
                    if seg is None:
                        raise KeyError(f"chunk {first} belongs to no segment of the store")
                    count = min(n, seg.first_chunk + seg.n_chunks - first, max_chunks)
                    out.append((seg, first, count))
                    first, n = first + count, n - count
        return out

    def expected_checksums(self, layer: int, kind: int, chunk: int) -> tuple[int, ...] | None:
        """The chunk's per-head checksums (as `manifest.chunk_checksums` gives them); None if no segment holds it."""
        with self.lock:
            seg = self.catalog.segment_of(chunk)
            if seg is None:
                return None
            return tuple(seg.checksums[layer, kind, chunk - seg.first_chunk, :self.layout.heads(kind)].tolist())

    def extent_of(self, layer: int, kind: int, chunk: int) -> tuple[str, int]:
        """(key under the store's kvstore, byte offset) of a chunk: its segment's extent of that layer and kind
        (stores.kvarray); fsck and tests locate bytes on disk with it."""
        with self.lock:
            seg = self.catalog.segment_of(chunk)
            if seg is None:
                raise KeyError(f"chunk {chunk} belongs to no segment of the store")
            key, offset = self.arrays.extent_of(layer, kind, seg.first_chunk, seg.n_chunks, chunk)
        return "kv/" + key, offset

    def stored_chunk_ids(self) -> set[int]:
        """Chunk ids of every segment with any extent on disk, committed or not."""
        return self.arrays.stored_chunk_ids()

    def writer_ranges(self) -> list[tuple[int, int]]:
        """The chunk-id ranges [lo, hi) live writers have reserved (their inserts may still commit)."""
        return [tuple(r) for entry in self.catalog.writers.values() for r in entry.get("ranges", [])]

    def refresh(self, force: bool = False) -> bool:
        """Adopt what other handles committed since (at most every `refresh_s`, unless `force`); True if anything was
        new."""
        if self.refresh_s and not force:
            now = time.monotonic()
            if now - self._refreshed_at < self.refresh_s:
                return False
            self._refreshed_at = now
        try:
            if not self.catalog.refresh():
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
        with self.lock:
            steps = self.tree.match(tokens)
            self._pin_snapshot(self.generation, [s.node_id for s in steps])
            return Match(self._release_snapshot, steps, tokens, self.generation)

    def join(self, matches) -> Match:
        """One match over several matched sequences laid end to end (text chunks cached independently and read
        as one context, CacheBlend): its position p is position p - start of the part holding it. It pins what
        it reads, as old a snapshot as its oldest part, until closed, independently of the parts."""
        steps, tokens, start = [], [], 0
        for m in matches:
            steps += [dataclasses.replace(s, prefix_start=s.prefix_start + start) for s in m.steps]
            tokens.append(m.tokens)
            start += m.length
        with self.lock:
            generation = min((m.generation for m in matches), default=self.generation)
            self._pin_snapshot(generation, [s.node_id for s in steps])
        return Match(self._release_snapshot, steps, np.concatenate(tokens) if tokens else np.zeros(0, np.int64),
                     generation)

    def open_matches(self) -> int:
        """How many matches of this handle are open (each pins a snapshot until closed)."""
        with self.lock:
            return sum(self._snapshots.values())

    def _pin_snapshot(self, generation: int, node_ids) -> None:
        """Keep a generation's manifest and these nodes' chunks alive until `_release_snapshot` (lock held)."""
        self._snapshots[generation] += 1
        for n in node_ids:
            self._pinned[n] += 1

    def _release_snapshot(self, generation: int, node_ids: tuple) -> None:
        with self.lock:
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
        with self.lock:
            free = self.catalog.take_free(min(self._snapshots, default=None))
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

    def free_callbacks(self) -> list:
        """The callbacks `on_free` registered, in order."""
        return list(self._free_callbacks)

    def _delete_segment(self, seg: Segment, on_disk: bool = True, callbacks: bool = True) -> None:
        chunk_ids = range(seg.first_chunk, seg.first_chunk + seg.n_chunks)
        for cb in self._free_callbacks if callbacks else ():
            cb(chunk_ids)
        if not on_disk:
            return
        try:
            self.arrays.delete_range(seg.first_chunk, seg.n_chunks)
        except Exception as e:  # noqa: BLE001 -- an undeleted orphan is harmless; reopening removes it
            log.warning("could not delete chunks %d..%d: %s", seg.first_chunk, seg.first_chunk + seg.n_chunks, e)

    def discard(self, seg: Segment) -> None:
        """A new segment will not be committed (its insert failed or was aborted): forget it and delete its chunks,
        unless it was published after all."""
        with self.lock:
            if seg.committed:
                return  # published after all (the error came after the manifest was replaced)
            self.catalog.forget(seg)
        self._delete_segment(seg)

    def collect_orphans(self) -> int:
        """Delete chunk files that no committed segment owns and no live writer can still commit (left by
        writers that died, or by removals whose deletion was cut short); returns how many."""
        listed = self.arrays.stored_chunk_ids()  # before the manifest the decision reads
        orphans = self.catalog.collect_orphans(listed)
        for first, n in consecutive_runs(orphans, 1 << 20):
            self.arrays.delete_range(first, n)
        if orphans:
            log.info("removed %d orphan chunks from %s", len(orphans), self.where)
        return len(orphans)

    # -- room for new segments -----------------------------------------------------------------

    def chunk_bytes_all_layers(self) -> int:
        lay = self.layout
        return lay.num_layers * sum(lay.chunk_nbytes(kind) for kind in lay.kinds())

    def live_chunks(self) -> int:
        with self.lock:
            return sum(s.n_chunks for s in self.catalog.segments.values() if not s.retired)

    @property
    def disk_bytes_used(self) -> int:
        return self.live_chunks() * self.chunk_bytes_all_layers()

    def allocate(self, n_tokens: int) -> Segment:
        """A new, uncommitted segment of `n_tokens` (its chunk ids reserved for this handle); least recently matched
        prefixes are evicted while the disk's capacity is short of it."""
        if self.read_only:
            raise StoreError(f"the KV store at {self.where} was opened read-only")
        lay = self.layout
        n_chunks = -(-n_tokens // lay.chunk_tokens)
        need = n_chunks * self.chunk_bytes_all_layers()
        with self.lock:
            if self.disk_capacity_bytes is not None:
                if need > self.disk_capacity_bytes:
                    raise DiskFullError(f"{n_tokens} tokens need {need} bytes, more than the store's disk "
                                        f"capacity of {self.disk_capacity_bytes} bytes; raise the capacity")
                self.catalog.refresh()
                while self.disk_bytes_used + need > self.disk_capacity_bytes:
                    if not self._evict_one():
                        raise DiskFullError(f"the KV store at {self.where} is at its disk capacity of "
                                            f"{self.disk_capacity_bytes} bytes and every prefix is in use")
            first = self.catalog.take_chunks(n_chunks)
            seg = Segment(first + 1, first, n_chunks, n_tokens,
                          np.zeros((lay.num_layers, lay.kind_slots, n_chunks, lay.max_heads), np.uint32))
            self.catalog.add(seg)
        return seg

    def _evict_one(self) -> bool:
        """Drop the least recently matched unpinned whole prefix tail (a leaf node); False if none."""
        def evict():
            leaves = [n for n in self.tree.leaves() if n.node_id not in self._pinned]
            if not leaves:
                return Change(False, publish=False)
            self.tree.remove_leaf(min(leaves, key=lambda n: n.last_access).node_id)
            return Change(True)

        return self.catalog.transact(evict)

    def publish_insert(self, seg: Segment, tokens: np.ndarray, base_len: int) -> int | None:
        """Publish a durable new segment as `tokens[base_len:]` below their first `base_len` (merged with others'
        commits); returns the new node id, or None (the segment discarded) if another insert stored them meanwhile
        or their base was evicted by another handle."""
        def insert():
            try:
                node_id, created = self.tree.insert(tokens, seg.seg_id, base_len)
            except KeyError:
                log.info("insert dropped: its base prefix was evicted meanwhile by another handle")
                return Change(None, publish=False)
            return Change(node_id, publish=node_id is not None or bool(created))

        node_id = self.catalog.transact(insert, publishes=[seg])
        if node_id is None:
            self.discard(seg)
        self.collect_garbage()
        return node_id

    # -- where matched tokens are --------------------------------------------------------------

    def locate(self, match: Match, positions, layer: int | None = None) -> Locations:
        """Chunk id and offset of each original prefix position of `layer` (through each node's mapping list;
        `layer` may be None only while no node on the path is reordered per layer)."""
        pos = np.asarray(positions, np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= match.length):
            raise IndexError(f"positions must lie in [0, {match.length}) of the matched prefix")
        step_of = match.step_of(pos)
        chunks = np.empty(pos.shape, np.int64)
        offsets = np.empty(pos.shape, np.int64)
        c = self.layout.chunk_tokens
        with self.lock:
            for i in np.unique(step_of):
                step = match.steps[i]
                sel = step_of == i
                seg = self.catalog.segments[step.seg_id]
                stored = seg.stored(step.seg_start + pos[sel] - step.prefix_start, layer)
                chunks[sel] = seg.first_chunk + stored // c
                offsets[sel] = stored % c
        return Locations(chunks, offsets)

    def chunks_by_layer(self, match: Match) -> np.ndarray:
        """`[layers, match.length]`: the chunk id holding each matched position at every layer (`locate` of every
        position, for all layers at once)."""
        layers, c = self.layout.num_layers, self.layout.chunk_tokens
        out = np.empty((layers, match.length), np.int64)
        with self.lock:
            for step in match.steps:
                seg = self.catalog.segments[step.seg_id]
                original = step.seg_start + np.arange(step.length)
                stored = seg.mapping[:, original] if seg.mapping is not None and seg.mapping.ndim == 2 else \
                    seg.stored(original, None)
                out[:, step.prefix_start:step.prefix_start + step.length] = seg.first_chunk + stored // c
        return out

    def path_segments(self, match: Match) -> list[tuple[int, Segment]]:
        """(node id, segment) of each step of a match's path whose segment this generation still holds."""
        with self.lock:
            return [(step.node_id, self.catalog.segments[step.seg_id]) for step in match.steps
                    if step.seg_id in self.catalog.segments]

    # -- repair --------------------------------------------------------------------------------

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
        lost = self.catalog.transact(drop)
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
        with self.lock:
            for step in match.steps:
                seg = self.catalog.segments.get(step.seg_id)
                if seg is None:
                    continue
                seg.imp_count[step.seg_start:step.seg_start + step.length] += 1
                sel = (pos >= step.prefix_start) & (pos < step.prefix_start + step.length)
                np.add.at(seg.imp_sum, (slice(None), step.seg_start + pos[sel] - step.prefix_start), imp[:, sel])

    def node_importance(self, node_id: int, per_layer: bool = False) -> np.ndarray:
        """Average observed importance of each token of a node (0 where never observed): `[n]` averaged over
        layers, or `[layers, n]` with `per_layer`."""
        with self.lock:
            node = self.tree.nodes[node_id]
            seg = self.catalog.segments[node.seg_id]
            lo, hi = node.seg_start, node.seg_start + len(node)
            avg = seg.imp_sum[:, lo:hi] / np.maximum(seg.imp_count[lo:hi], 1)
            return avg if per_layer else avg.mean(axis=0)

    def node_observations(self, node_id: int) -> int:
        """How many requests reported importance for this node since it was last repacked."""
        with self.lock:
            node = self.tree.nodes[node_id]
            seg = self.catalog.segments[node.seg_id]
            counts = seg.imp_count[node.seg_start:node.seg_start + len(node)]
            return int(counts.max()) if len(counts) else 0

    def node_ids(self) -> list[int]:
        with self.lock:
            return [n for n in self.tree.nodes if n != RadixTree.ROOT]

    def node_view(self, node_id: int) -> tuple[int, int, int, Match]:
        """(seg_id, seg_start, n_tokens) of a node and a pinning snapshot of it (for copy-on-write)."""
        with self.lock:
            node = self.tree.nodes[node_id]
            steps = [PathStep(node_id, node.seg_id, node.seg_start, 0, len(node))]
            self._pin_snapshot(self.generation, [node_id])
            return (node.seg_id, node.seg_start, len(node),
                    Match(self._release_snapshot, steps, node.tokens, self.generation))

    def swap_segment(self, node_id: int, expect: tuple[int, int, int], new: Segment, mapping: np.ndarray) -> bool:
        """Point `node_id` at the durable new segment if it still is `expect` in the newest generation (others'
        commits meanwhile are kept); atomic for readers."""
        def swap():
            node = self.tree.nodes.get(node_id)
            if node is None or (node.seg_id, node.seg_start, len(node)) != expect:
                return Change(False, publish=False)  # split or evicted meanwhile: keep the old version
            old = self.catalog.segments[node.seg_id]
            lo, hi = node.seg_start, node.seg_start + len(node)
            new.mapping = mapping.astype(np.int32)
            new.imp_sum[:] = old.imp_sum[:, lo:hi]
            new.imp_count[:] = old.imp_count[lo:hi]
            node.seg_id, node.seg_start = new.seg_id, 0
            return Change(True)

        swapped = self.catalog.transact(swap, publishes=[new])
        if swapped:
            self.collect_garbage()
        return swapped

    # -- lifetime ------------------------------------------------------------------------------

    def stats(self) -> dict:
        self.refresh()
        with self.lock:
            live = [s for s in self.catalog.segments.values() if s.refs > 0]
            return {"generation": self.generation, "nodes": len(self.tree.nodes) - 1, "segments": len(live),
                    "chunks": sum(s.n_chunks for s in live), "tokens": sum(len(n) for n in self.tree.nodes.values()),
                    "disk_bytes_used": self.disk_bytes_used, "commits": self.catalog.commits,
                    "commit_conflicts": self.catalog.conflicts}

    def release(self) -> None:
        """Collect what no match reads any more and unregister this handle as a writer (its reserved, unused chunk
        ids lapse)."""
        self.collect_garbage()
        try:
            self.catalog.release()
        except Exception as e:  # noqa: BLE001 -- a writer left registered is collected once this process ends
            log.warning("could not unregister from the KV store at %s: %s", self.where, e)
