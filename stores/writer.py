"""Writing a new segment: layers queued write-behind, checksummed, durable before any manifest references them;
`PrefixWriter.commit()` then publishes the new prefix (merged with whatever other handles committed)."""

from __future__ import annotations

import concurrent.futures
import typing

import numpy as np

from specjax.stores import kvarray
from specjax.stores.catalog import Segment
from specjax.stores.errors import DiskFullError, StoreError, is_disk_full
from specjax.stores.kvarray import K, PROBE, V
from specjax.stores.manifest import chunk_checksums

if typing.TYPE_CHECKING:
    from specjax.stores.store import KVStore, Match


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
                chunks = data.reshape(lay.heads(kind), seg.n_chunks, lay.chunk_tokens, lay.head_dim).swapaxes(0, 1)
                checksums = chunk_checksums(chunks)
                seg.checksums[layer, kind, :, :lay.heads(kind)] = checksums
                if kind == K:  # the chunks' key summaries, while their keys are at hand
                    for j in range(seg.n_chunks):
                        self.store.summaries.put(layer, seg.first_chunk + j, tuple(checksums[j].tolist()), chunks[j])
                pending.append(self.store._arrays.write_range(layer, kind, seg.first_chunk, data))
            for w in pending:
                w.result()  # resolves once the chunk files are written and synced
        except Exception as e:  # noqa: BLE001 -- mapped to a clear store error
            if is_disk_full(e):
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

    def __init__(self, store: "KVStore", seg: Segment, tokens: np.ndarray, base: "Match | None"):
        super().__init__(store, seg)
        self.tokens = tokens
        self.base = base

    def commit(self) -> int | None:
        """Wait for every layer to be durable, then atomically publish; returns the new node id (None if the
        tokens were meanwhile stored by another insert, or their base prefix evicted by another process)."""
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
