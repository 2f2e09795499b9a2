"""Writing new segments for one store handle (`StoreWriter`): layers queued write-behind, checksummed, durable
before any manifest references them; `PrefixWriter.commit()` then publishes the new prefix through the store's index
(merged with whatever other handles committed)."""

from __future__ import annotations

import concurrent.futures
import typing

import numpy as np

from specjax.kernels import quant
from specjax.stores import kvarray
from specjax.stores.catalog import Segment
from specjax.stores.errors import DiskFullError, StoreError, disk_full_message, is_disk_full
from specjax.stores.kvarray import K, PROBE, V
from specjax.stores.manifest import chunk_checksums

if typing.TYPE_CHECKING:
    from specjax.stores.index import StoreIndex
    from specjax.stores.match import Match
    from specjax.stores.metrics import StoreMetrics
    from specjax.stores.summaries import KeySummaries


class StoreWriter:
    """New segments of one store: room for them from the index (`allocate`), their layers written on a pool of
    `threads` write-behind, each chunk's checksums and key summaries kept as it is written."""

    def __init__(self, index: "StoreIndex", metrics: "StoreMetrics", summaries: "KeySummaries", *, threads: int = 4):
        self.index, self.layout, self.metrics, self.summaries = index, index.layout, metrics, summaries
        self.arrays = index.arrays
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="kv-write")

    @property
    def where(self) -> str:
        return self.index.where

    def begin_insert(self, tokens, base: "Match | None" = None) -> "PrefixWriter":
        """Start storing `tokens[base.length:]` below the matched `base` (the writer owns and closes `base`).

        Write every layer with `writer.write_layer(...)`, then `writer.commit()`.
        """
        tokens = np.asarray(tokens, np.int64)
        base_len = base.length if base is not None else 0
        if base is not None and not np.array_equal(base.tokens, tokens[:base_len]):
            raise ValueError("base match is not a prefix of the tokens to insert")
        if base_len >= len(tokens):
            raise ValueError("nothing to insert: every token is already in the matched prefix")
        return PrefixWriter(self, self.index.allocate(len(tokens) - base_len), tokens, base)

    def insert(self, tokens, layers_kv, base: "Match | None" = None) -> int | None:
        """Synchronous convenience: `layers_kv[layer] = (k, v, probe_k)` for the new tokens."""
        writer = self.begin_insert(tokens, base)
        with writer:
            for layer, kv in enumerate(layers_kv):
                writer.write_layer(layer, *kv)
            return writer.commit()

    def new_segment_writer(self, n_tokens: int) -> "SegmentWriter":
        """A segment no node points at yet (a reordered copy: `StoreIndex.swap_segment` publishes it)."""
        return SegmentWriter(self, self.index.allocate(n_tokens))

    def close(self) -> None:
        """Finish the queued writes."""
        self.pool.shutdown(wait=True)


class SegmentWriter:
    """Writes one new segment layer by layer (write-behind); `wait_durable()` before it may be referenced."""

    def __init__(self, owner: StoreWriter, seg: Segment):
        self.owner, self.seg = owner, seg  # owner: the StoreWriter that made it
        self._layers: dict[int, concurrent.futures.Future] = {}
        self._closed = False

    @property
    def n_tokens(self) -> int:
        return self.seg.n_tokens

    def write_layer(self, layer: int, k, v, probe_k=None) -> concurrent.futures.Future:
        """Queue one layer's K, V `[kv_heads, n, head_dim]` and probe keys `[probe_heads, n, head_dim]`."""
        lay = self.owner.layout
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
        future = self.owner.pool.submit(self._write_layer_now, layer, arrays)
        self._layers[layer] = future
        return future

    def _write_layer_now(self, layer: int, arrays: dict) -> None:
        lay, seg = self.owner.layout, self.seg
        padded_tokens = seg.n_chunks * lay.chunk_tokens
        pending = []
        try:
            for kind, data in _padded_kinds(lay, arrays, padded_tokens):
                chunks = data.reshape(lay.heads(kind), seg.n_chunks, *lay.chunk_shape(kind)[1:]).swapaxes(0, 1)
                checksums = chunk_checksums(chunks)
                seg.checksums[layer, kind, :, :lay.heads(kind)] = checksums
                if kind == K:  # the chunks' key summaries, while their keys are at hand
                    for j in range(seg.n_chunks):
                        self.owner.summaries.put(layer, seg.first_chunk + j, tuple(checksums[j].tolist()), chunks[j])
                pending.append(self.owner.arrays.write_range(layer, kind, seg.first_chunk, data))
            for w in pending:
                w.result()  # resolves once the chunk files are written and synced
        except Exception as e:  # noqa: BLE001 -- mapped to a clear store error
            if is_disk_full(e):
                where = self.owner.where
                raise DiskFullError(disk_full_message(f"writing the KV store at {where}", where, "free space or set "
                                                      "a smaller disk capacity (reads still work)")) from None
            raise StoreError(f"writing layer {layer} to the KV store at {self.owner.where} failed: {e}") from e
        self.owner.metrics.add(disk_bytes_written=seg.n_tokens * sum(lay.token_nbytes(kind) for kind in lay.kinds()))

    def wait_durable(self) -> None:
        missing = sorted(set(range(self.owner.layout.num_layers)) - set(self._layers))
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
            self.owner.index.discard(self.seg)


def _padded_kinds(lay: kvarray.Layout, arrays: dict, padded_tokens: int):
    """(kind, `[heads, padded_tokens, width]` of the store dtype) for every kind of the layout: the given K, V (and
    probe keys) with zero rows after their tokens, and each of them again at each of the layout's low precisions,
    encoded from those: K per chunk and channel (`kernels.quant.encode_key_chunks`, its chunks' ranges once as
    `K_RANGE`, over the tokens' keys, not the padding), V and probe keys per row (`encode_rows`)."""
    full = {}
    for kind, a in arrays.items():
        data = full[kind] = np.zeros((lay.heads(kind), padded_tokens, lay.head_dim), lay.np_dtype)
        a = np.asarray(a)
        data[:, :a.shape[1]] = a
        yield kind, data
    ranges = None
    for bits in lay.bits:
        for kind in tuple(full):
            low = kvarray.low_bit(kind, bits)
            if kind == K:
                rows, ranges = quant.encode_key_chunks(full[K], bits=bits, chunk_tokens=lay.chunk_tokens,
                                                       keys=np.arange(padded_tokens) < np.shape(arrays[K])[1])
            else:
                rows = quant.encode_rows(full[kind], bits=bits, group=lay.group_channels,
                                         row_bytes=lay.token_row_nbytes(low))
            yield low, rows
    if ranges is not None:
        yield kvarray.K_RANGE, ranges


class PrefixWriter(SegmentWriter):
    """New prefix tokens appended below a matched prefix; `commit()` makes them visible and durable."""

    def __init__(self, owner: StoreWriter, seg: Segment, tokens: np.ndarray, base: "Match | None"):
        super().__init__(owner, seg)
        self.tokens = tokens
        self.base = base

    def commit(self) -> int | None:
        """Wait for every layer to be durable, then atomically publish; returns the new node id (None if the
        tokens were meanwhile stored by another insert, or their base prefix evicted by another process)."""
        if self._closed:
            raise StoreError("this insert was already committed or aborted")
        try:
            self.wait_durable()
            node_id = self.owner.index.publish_insert(self.seg, self.tokens,
                                                      self.base.length if self.base is not None else 0)
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
