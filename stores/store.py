"""`KVStore`: persistent prefix KV on TensorStore, indexed by a radix tree, checksummed, crash-safe, shared.

A handle is three parts, each usable on its own: its `index` (stores/index.py: what the store holds, the matches
open on it, when chunks may be deleted), its `reader` (stores/reads.py: chunks and located positions read through
the disk's scheduler and verified) and its `writer` (stores/writer.py: new segments written behind and published).
`KVStore` opens them over one location and passes on the calls its users make; fsck, the reorderer and the engine
use the same public methods.

Many processes (on many hosts, given a shared file system or an object store) may open one store: commits
merge instead of overwriting each other (stores/catalog.py), a handle adopts others' commits when it matches,
and orphan collection spares chunks that a live writer may still commit (stores/leases.py).
"""

from __future__ import annotations

import functools

import numpy as np
import tensorstore as ts

from specjax.stores import kvarray, leases
from specjax.stores.catalog import Segment
from specjax.stores.index import StoreIndex
from specjax.stores.manifest import layout_from_fingerprint
from specjax.stores.kvarray import KVArrays
from specjax.stores.manifest import ManifestIO
from specjax.stores.match import Match
from specjax.stores.metrics import StoreMetrics
from specjax.stores.locations import Locations
from specjax.stores.reads import ChunkRead, ChunkReader, Gathered, Run, when_all
from specjax.stores.summaries import KeySummaries
from specjax.stores.writer import PrefixWriter, SegmentWriter, StoreWriter

__all__ = ["ChunkRead", "Gathered", "KVStore", "Locations", "Match", "PrefixWriter", "Run", "Segment", "SegmentWriter",
           "kvstore_spec", "layout_from_fingerprint", "when_all"]


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


class KVStore:
    """Prefix KV store: match, write, read by token position, importance feedback; see module docstring. Its parts
    are `index`, `reader` and `writer`; the methods below pass each call to the part that answers it.

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
        self.metrics = StoreMetrics()
        self.summaries = KeySummaries()  # per-chunk key summaries in host memory (`key_summaries`)
        io = ManifestIO(self.kvstore_spec, self.context)
        arrays = functools.partial(KVArrays, self.kvstore_spec, context=self.context, disk_bandwidth=disk_bandwidth,
                                   max_inflight_bytes=max_inflight_bytes, direct_io=direct_io)
        self.index = StoreIndex(io, arrays, fingerprint, create=create, read_only=read_only,
                                disk_capacity_bytes=disk_capacity_bytes, lease_s=lease_s, refresh_s=refresh_s,
                                retire_grace_s=retire_grace_s,
                                local=io.local_dir is not None or self.kvstore_spec.get("driver") == "memory")
        self.reader = ChunkReader(self.index, self.metrics, self.summaries, max_read_bytes=max_read_bytes)
        self.writer = StoreWriter(self.index, self.metrics, self.summaries, threads=write_threads)
        self._closed = False
        if gc_orphans and not read_only:
            self.index.collect_orphans()

    @classmethod
    def open(cls, location, fingerprint: dict | None = None, **kwargs) -> "KVStore":
        return cls(location, fingerprint, **kwargs)

    # -- what the store holds, and the matches on it (`index`) ----------------------------------

    @property
    def layout(self):
        return self.index.layout

    @property
    def fingerprint(self) -> dict:
        return self.index.fingerprint

    @property
    def where(self) -> str:
        return self.index.where

    @property
    def read_only(self) -> bool:
        return self.index.read_only

    @property
    def generation(self) -> int:
        return self.index.generation

    @property
    def tree(self):
        return self.index.tree

    @property
    def disk_bytes_used(self) -> int:
        return self.index.disk_bytes_used

    @property
    def summary_bytes(self) -> int:
        """Host memory the key summaries of every stored chunk take (`key_summaries`): 2 / chunk_tokens of K."""
        lay = self.layout
        return self.index.live_chunks() * lay.num_layers * lay.kv_heads * 2 * lay.head_dim * lay.np_dtype.itemsize

    def segments(self, *, referenced: bool = False) -> list[Segment]:
        return self.index.segments(referenced=referenced)

    def stored_chunk_ids(self) -> set[int]:
        return self.index.stored_chunk_ids()

    def writer_ranges(self) -> list[tuple[int, int]]:
        return self.index.writer_ranges()

    def refresh(self, force: bool = False) -> bool:
        return self.index.refresh(force)

    def match(self, tokens) -> Match:
        return self.index.match(tokens)

    def join(self, matches) -> Match:
        return self.index.join(matches)

    def collect_garbage(self) -> int:
        return self.index.collect_garbage()

    def collect_orphans(self) -> int:
        return self.index.collect_orphans()

    def on_free(self, callback) -> None:
        self.index.on_free(callback)

    def off_free(self, callback) -> None:
        self.index.off_free(callback)

    def locate(self, match: Match, positions, layer: int | None = None) -> Locations:
        return self.index.locate(match, positions, layer)

    def chunks_by_layer(self, match: Match) -> np.ndarray:
        return self.index.chunks_by_layer(match)

    def extent_of(self, layer: int, kind: int, chunk: int) -> tuple[str, int]:
        return self.index.extent_of(layer, kind, chunk)

    def drop_nodes(self, node_ids) -> list[np.ndarray]:
        return self.index.drop_nodes(node_ids)

    def record_importance(self, match: Match, importance, positions=None) -> None:
        self.index.record_importance(match, importance, positions)

    def node_importance(self, node_id: int, per_layer: bool = False) -> np.ndarray:
        return self.index.node_importance(node_id, per_layer)

    def node_observations(self, node_id: int) -> int:
        return self.index.node_observations(node_id)

    def node_ids(self) -> list[int]:
        return self.index.node_ids()

    def node_view(self, node_id: int) -> tuple[int, int, int, Match]:
        return self.index.node_view(node_id)

    def swap_segment(self, node_id: int, expect: tuple[int, int, int], writer: SegmentWriter,
                     mapping: np.ndarray) -> bool:
        """Point `node_id` at `writer`'s durable new segment (`StoreIndex.swap_segment`)."""
        return self.index.swap_segment(node_id, expect, writer.seg, mapping)

    def stats(self) -> dict:
        return self.index.stats()

    # -- reading (`reader`) ------------------------------------------------------------------------

    @property
    def scheduler(self):
        """The disk's read queue (stores.scheduler): its measured rate, what waits in it."""
        return self.reader.scheduler

    def split_reads(self, devices: dict[int, int], own: dict[int, range] | None = None,
                    by_process: frozenset = frozenset()) -> None:
        self.reader.split_reads(devices, own, by_process)

    def own_heads(self, kind: int) -> slice:
        return self.reader.own_heads(kind)

    def every_head(self):
        return self.reader.every_head()

    def read_runs(self, layer: int, kind: int, chunks, *, speculative: bool = False,
                  background: bool = False) -> list[Run]:
        return self.reader.read_runs(layer, kind, chunks, speculative=speculative, background=background)

    def read_chunks(self, layer: int, kind: int, chunks, *, speculative: bool = False,
                    background: bool = False) -> list[ChunkRead]:
        return self.reader.read_chunks(layer, kind, chunks, speculative=speculative, background=background)

    def read_chunk(self, layer: int, kind: int, chunk: int, *, speculative: bool = False):
        return self.reader.read_chunk(layer, kind, chunk, speculative=speculative)

    def read_locations(self, layer: int, kind: int, loc: Locations):
        return self.reader.read_locations(layer, kind, loc)

    def expedite(self, run: Run) -> None:
        self.reader.expedite(run)

    def waiting(self, run: Run) -> bool:
        return self.reader.waiting(run)

    def withdraw(self, run: Run, chunks: int = 1) -> None:
        self.reader.withdraw(run, chunks)

    def key_summaries(self, layer: int, chunks) -> Gathered:
        return self.reader.key_summaries(layer, chunks)

    def failing_nodes(self, match: Match) -> list[int]:
        return self.reader.failing_nodes(match)

    # -- writing (`writer`) ------------------------------------------------------------------------

    def begin_insert(self, tokens, base: Match | None = None) -> PrefixWriter:
        return self.writer.begin_insert(tokens, base)

    def insert(self, tokens, layers_kv, base: Match | None = None) -> int | None:
        return self.writer.insert(tokens, layers_kv, base)

    def new_segment_writer(self, n_tokens: int) -> SegmentWriter:
        return self.writer.new_segment_writer(n_tokens)

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish queued writes and unregister this handle as a writer (its reserved, unused chunk ids lapse)."""
        self.writer.close()
        if not self._closed:
            self._closed = True
            self.index.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
