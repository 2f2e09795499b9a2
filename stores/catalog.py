"""The store's shared metadata and how a handle changes it: radix tree, segments, writers and chunk-id
reservations as of the newest manifest generation; commits that merge with every other process's.

A *change* is a function applied to the newest generation: insert these tokens below this prefix, remove
this leaf, point this node at that segment if it still is what it was, reserve chunk ids, remove dead
writers. `Catalog.transact` takes the manifest's lock (local directory) and adopts the newest generation if
another handle published since, applies the change and publishes generation g+1 conditionally on g; on an
object store, where a conditional write replaces the lock, a write that lost the race adopts the winner's
generation and applies the change again. Since changes are expressed on the tree, applying one again to a
newer tree merges it: no commit ever overwrites another's. A failed publish adopts the published generation
back, so memory never runs ahead of disk.

Chunk ids (and the segment ids derived from them) are unique across processes: a handle reserves ranges of
chunk ids in a commit that also registers it as a writer (stores/leases.py) before it writes a chunk.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time

import numpy as np

from specjax.stores import leases
from specjax.stores.errors import DiskFullError, ManifestError, StoreError, disk_full_message, is_disk_full
from specjax.stores.manifest import FORMAT, ManifestIO, decode_array, encode_array
from specjax.stores.radix import RadixTree

log = logging.getLogger(__name__)

RESERVE_CHUNKS = 4096  # chunk ids reserved per reservation commit (more when one segment needs more)


@dataclasses.dataclass
class Segment:
    seg_id: int
    first_chunk: int
    n_chunks: int
    n_tokens: int
    checksums: np.ndarray             # uint32 [num_layers, kinds, n_chunks, heads] (Layout.max_heads; 0 past a kind's)
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


@dataclasses.dataclass
class Change:
    """What a change function returns: `result` for its caller; `publish` False when it changed nothing."""
    result: object = None
    publish: bool = True


def _covers(intervals: list[tuple[int, int]]):
    """A predicate `chunk -> bool`: inside any of the half-open `intervals`."""
    merged: list[list[int]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    starts = [lo for lo, _ in merged]

    def covered(c: int) -> bool:
        i = bisect.bisect_right(starts, c) - 1
        return i >= 0 and c < merged[i][1]

    return covered


class Catalog:
    """One handle's view of the shared metadata (guarded by the store's lock) and its commit protocol."""

    def __init__(self, io: ManifestIO, lock, *, read_only: bool, lease_s: float):
        self.io, self.lock, self.read_only, self.lease_s = io, lock, read_only, lease_s
        self.tree = RadixTree()
        self.segments: dict[int, Segment] = {}   # committed, this handle's uncommitted, retired still readable
        self.generation = 0
        self.next_chunk = 0                      # every chunk id below it is reserved (by some writer)
        self.writers: dict[str, dict] = {}
        self.header: dict = {}                   # fingerprint and layout, fixed at creation
        self.retired: list[tuple[int, Segment, bool]] = []  # (first generation without it, seg, ours to delete)
        self.stamp = None
        self.commits = self.conflicts = 0
        self.writer_id, self._entry = leases.new_writer()
        self._range = (0, 0)                     # this handle's unused reserved chunk ids
        self._heartbeat: leases.Heartbeat | None = None
        self._dirty = False                      # memory may differ from every published generation
        self._firsts: list[int] = []             # sorted first chunk ids, to find a chunk's segment
        self._by_first: dict[int, int] = {}

    @staticmethod
    def initial_body(fingerprint: dict, layout: dict) -> dict:
        return {"format": FORMAT, "generation": 1, "fingerprint": fingerprint, "layout": layout,
                "next_chunk": 0, "next_node": 1, "writers": {}, "segments": [], "nodes": []}

    # -- the manifest body ------------------------------------------------------------------------

    def adopt(self, body: dict, stamp) -> None:
        """Make generation `body` this handle's view (lock held), keeping what only this handle knows: its
        uncommitted segments, importance, recency, and retired segments open matches may still read."""
        self.header = {"fingerprint": body["fingerprint"], "layout": body["layout"]}
        self.generation = body["generation"]
        self.next_chunk = body["next_chunk"]
        self.writers = body.get("writers", {})
        for s in body["segments"]:
            seg = self.segments.get(s["id"])
            if seg is None:
                seg = Segment(s["id"], s["first_chunk"], s["n_chunks"], s["n_tokens"],
                              decode_array(s["checksums"]), decode_array(s["mapping"]))
                self.add(seg)
            elif seg.first_chunk != s["first_chunk"] or seg.retired:
                raise ManifestError(f"segment {s['id']} of the KV store at {self.io.where} changed under this "
                                    f"handle; the store is damaged or shared with an older specjax")
            seg.committed = True
        old = self.tree
        self.tree = RadixTree.from_records([dict(r, tokens=decode_array(r["tokens"])) for r in body["nodes"]],
                                           body.get("next_node", 0))
        self.tree.keep_recency_of(old)
        self._recount()
        self._settle(ours=False)
        self._set_stamp(stamp)
        self._dirty = False

    def body(self) -> dict:
        segments = [{"id": s.seg_id, "first_chunk": s.first_chunk, "n_chunks": s.n_chunks, "n_tokens": s.n_tokens,
                     "checksums": encode_array(s.checksums), "mapping": encode_array(s.mapping)}
                    for s in self.segments.values() if s.refs > 0]
        nodes = [dict(r, tokens=encode_array(r["tokens"])) for r in self.tree.to_records()]
        return dict(self.header, format=FORMAT, generation=self.generation, next_chunk=self.next_chunk,
                    next_node=self.tree.next_id, writers=self.writers, segments=segments, nodes=nodes)

    def _set_stamp(self, stamp) -> None:
        if self.stamp is not None and self.stamp is not stamp and hasattr(self.stamp, "close"):
            self.stamp.close()
        self.stamp = stamp

    def _recount(self) -> None:
        for seg in self.segments.values():
            seg.refs = 0
        for node in self.tree.nodes.values():
            if node.seg_id is not None:
                self.segments[node.seg_id].refs += 1

    def _settle(self, ours: bool) -> None:
        """After a generation is adopted or published: segments in the tree are committed; committed ones no
        longer in it are retired (and deleted by this handle only if its own commit removed them)."""
        for seg in list(self.segments.values()):
            if seg.refs > 0:
                seg.committed = True
            elif seg.committed and not seg.retired:
                seg.retired = True
                self.retired.append((self.generation, seg, ours))

    # -- segments ---------------------------------------------------------------------------------

    def add(self, seg: Segment) -> None:
        self.segments[seg.seg_id] = seg
        bisect.insort(self._firsts, seg.first_chunk)
        self._by_first[seg.first_chunk] = seg.seg_id

    def forget(self, seg: Segment) -> None:
        self.segments.pop(seg.seg_id, None)
        if self._by_first.pop(seg.first_chunk, None) is not None:
            self._firsts.remove(seg.first_chunk)

    def segment_of(self, chunk: int) -> Segment | None:
        i = bisect.bisect_right(self._firsts, chunk) - 1
        if i < 0:
            return None
        seg = self.segments.get(self._by_first[self._firsts[i]])
        return seg if seg is not None and chunk < seg.first_chunk + seg.n_chunks else None

    def take_free(self, oldest_snapshot: int | None) -> list[tuple[Segment, bool]]:
        """Retired segments no open match can read any more, forgotten: (seg, ours to delete)."""
        free = [(s, ours) for g, s, ours in self.retired if oldest_snapshot is None or oldest_snapshot >= g]
        if free:
            gone = {id(s) for s, _ in free}
            self.retired = [r for r in self.retired if id(r[1]) not in gone]
            for seg, _ in free:
                self.forget(seg)
        return free

    # -- the commit protocol ----------------------------------------------------------------------

    def refresh(self) -> bool:
        """Adopt the newest generation if another handle published one; True if it did."""
        got = self.io.read_if_changed(None if self._dirty else self.stamp)
        if got is None:
            return False
        with self.lock:
            if got[0]["generation"] <= self.generation and not self._dirty:
                return False  # this handle has published as new a generation meanwhile
            self.adopt(*got)
        return True

    def _sync(self, force: bool) -> None:
        got = self.io.read() if force or self._dirty else self.io.read_if_changed(self.stamp)
        if got is not None and got[0] is None:
            raise ManifestError(f"the manifest of the KV store at {self.io.where} has disappeared")
        if got is not None and (force or self._dirty or got[0]["generation"] > self.generation):
            self.adopt(*got)

    def transact(self, change, publishes=()):
        """Apply `change()` to the newest generation and publish the result as the next one, merging with
        every commit published meanwhile; returns the change's result. `publishes`: new segments the change
        references, which must lie in chunk ranges this handle still holds."""
        if self.read_only:
            raise StoreError(f"the KV store at {self.io.where} was opened read-only")
        with self.lock, self.io.locked():
            force = False
            while True:
                self._sync(force)
                for seg in publishes:
                    if not self.holds(seg):
                        raise StoreError(f"this handle's writer lease on the KV store at {self.io.where} was "
                                         f"revoked (it looked dead to another process); the insert is dropped")
                out = change()
                if not out.publish:
                    return out.result
                self._recount()
                self.generation += 1
                self._dirty = True
                try:
                    stamp = self.io.publish(self.body(), self.stamp)
                except BaseException as e:
                    self._rollback()
                    if is_disk_full(e):
                        raise DiskFullError(disk_full_message(
                            f"committing the manifest of the KV store at {self.io.where}", self.io.local_dir,
                            "free space (reads still work)")) from None
                    raise
                if stamp is None:  # another handle published first: merge with it and apply again
                    self.conflicts += 1
                    force = True
                    continue
                self._set_stamp(stamp)
                self._dirty = False
                self.commits += 1
                self._settle(ours=True)
                return out.result

    def _rollback(self) -> None:
        try:
            self._sync(force=True)
        except Exception as e:  # noqa: BLE001 -- stays dirty: the next refresh re-reads
            log.warning("could not re-read the manifest of %s after a failed commit: %s", self.io.where, e)

    # -- writers and chunk ids --------------------------------------------------------------------

    def holds(self, seg: Segment) -> bool:
        """Whether `seg`'s chunks lie in ranges reserved to this handle (its lease was not revoked)."""
        return self._held(seg.first_chunk, seg.n_chunks)

    def _held(self, first: int, n: int) -> bool:
        entry = self.writers.get(self.writer_id)
        return entry is not None and any(lo <= first and first + n <= hi for lo, hi in entry["ranges"])

    def take_chunks(self, n: int) -> int:
        """First of `n` fresh chunk ids, from this handle's reserved range, reserving more in a commit."""
        with self.lock:
            lo, hi = self._range
            if hi - lo >= n and self._held(lo, n):
                self._range = (lo + n, hi)
                return lo
            if self._heartbeat is None:
                self._heartbeat = leases.Heartbeat(self.io, self.writer_id, self.lease_s)
            want = max(n, RESERVE_CHUNKS)

            def reserve():
                first = self.next_chunk
                self.next_chunk += want
                entry = self.writers.setdefault(self.writer_id, dict(self._entry, ranges=[]))
                if entry["ranges"] and entry["ranges"][-1][1] == first:
                    entry["ranges"][-1][1] = first + want
                else:
                    entry["ranges"].append([first, first + want])
                return Change(first)

            first = self.transact(reserve)
            self._range = (first + n, first + want)
            return first

    def _orphans(self, listed: set[int]) -> tuple[list[str], list[int]]:
        """(writers that are dead, chunks among `listed` no segment owns and no live writer's range covers)."""
        now = time.time()
        dead = [w for w, e in self.writers.items() if w != self.writer_id and not leases.alive(
            w, e, lambda wid: leases.read_heartbeat(self.io, wid), self.lease_s, now)]
        keep = [(s.first_chunk, s.first_chunk + s.n_chunks) for s in self.segments.values()]
        keep += [(lo, hi) for w, e in self.writers.items() if w not in dead for lo, hi in e["ranges"]]
        covered = _covers(keep)
        return dead, sorted(c for c in listed if not covered(c))

    def collect_orphans(self, listed: set[int]) -> list[int]:
        """Chunk ids among `listed` (all that existed before this call) that no segment owns and no live
        writer can still commit; the caller deletes them. Dead writers are removed from the manifest first
        (a commit); without any, no commit is needed: chunk ids below `next_chunk` outside every range can
        never be committed, as new ranges start at `next_chunk`."""
        self.refresh()
        with self.lock:
            dead, orphans = self._orphans(listed)
        if dead or (orphans and orphans[-1] >= self.next_chunk):
            def change():
                dead[:], orphans[:] = self._orphans(listed)
                for w in dead:
                    del self.writers[w]
                beyond = bool(orphans) and orphans[-1] >= self.next_chunk  # never hand out an id that had files
                if beyond:
                    self.next_chunk = orphans[-1] + 1
                return Change(publish=bool(dead) or beyond)

            self.transact(change)
        for w in dead:
            log.info("writer %s of %s is gone; its uncommitted chunks are collected", w, self.io.where)
            try:
                self.io.delete(leases.HEARTBEAT_PREFIX + w)
            except Exception as e:  # noqa: BLE001 -- a stale heartbeat key is harmless
                log.warning("could not remove heartbeat of %s: %s", w, e)
        return orphans

    def release(self) -> None:
        """Unregister this handle as a writer (its unused chunk ids are given up)."""
        if self._heartbeat is None:
            return

        def unregister():
            return Change(publish=self.writers.pop(self.writer_id, None) is not None)

        try:
            self.transact(unregister)
        finally:
            self._range = (0, 0)
            self._heartbeat.stop()
            self._heartbeat = None
