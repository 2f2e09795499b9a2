"""The on-disk KV and probe-key arrays (TensorStore zarr3), reads of chunk runs through one read scheduler, O_DIRECT.

Layout: `kv[layer, kv(2), kv_head, slot, head_dim]` and `probe[layer, probe_head, slot, head_dim]`, one storage
chunk per `chunk_tokens` slots, so a read of (layer, K|V|probe, chunk) touches exactly one file.

Writes go through the zarr arrays. Reads fetch the chunk files themselves from the same TensorStore kvstore: with the
`bytes` codec a chunk file holds exactly the chunk's little-endian elements, so the hot path skips the array
driver's per-read indexing and decoding.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time

import numpy as np
import tensorstore as ts

from specjax.stores.scheduler import Read, ReadScheduler, when_all

K, V, PROBE = 0, 1, 2
KIND_NAMES = ("k", "v", "probe")
MAX_CHUNKS = 2**31  # slot axis length in chunks; zarr stores only chunks that exist


@dataclasses.dataclass(frozen=True)
class Layout:
    num_layers: int
    kv_heads: int
    head_dim: int
    probe_heads: int
    chunk_tokens: int = 64
    dtype: str = "float32"

    def __post_init__(self):
        if self.chunk_tokens <= 0 or self.num_layers <= 0 or self.kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"layout sizes must be positive, got {self}")
        if self.probe_heads < 0:
            raise ValueError(f"probe_heads must be >= 0, got {self.probe_heads}")

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype) if self.dtype != "bfloat16" else np.dtype(_bfloat16())

    def heads(self, kind: int) -> int:
        return self.probe_heads if kind == PROBE else self.kv_heads

    @property
    def max_heads(self) -> int:
        return max(self.kv_heads, self.probe_heads)

    def head_chunk_nbytes(self) -> int:
        """Bytes of one head in a chunk file: a chunk holds its heads one after another."""
        return self.chunk_tokens * self.head_dim * self.np_dtype.itemsize

    def chunk_nbytes(self, kind: int) -> int:
        return self.heads(kind) * self.chunk_tokens * self.head_dim * self.np_dtype.itemsize

    def token_nbytes(self, kind: int) -> int:
        return self.heads(kind) * self.head_dim * self.np_dtype.itemsize

    def kinds(self) -> tuple[int, ...]:
        return (K, V, PROBE) if self.probe_heads else (K, V)


def _bfloat16():
    import ml_dtypes  # shipped with jax

    return ml_dtypes.bfloat16


class Throttle:
    """Token-bucket emulation of a link of `bytes_per_s`: each transfer is given the time it would finish."""

    def __init__(self, bytes_per_s: float):
        if bytes_per_s <= 0:
            raise ValueError(f"throttle bandwidth must be > 0 bytes/s, got {bytes_per_s}")
        self.bytes_per_s = float(bytes_per_s)
        self._free_at = 0.0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> float:
        """Book the link for `nbytes`; returns the monotonic time at which they have crossed it."""
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + nbytes / self.bytes_per_s
            return self._free_at

    def consume(self, nbytes: int) -> None:
        """Block the calling thread until `nbytes` have crossed the emulated link."""
        delay = self.reserve(nbytes) - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def _under(kvstore: dict, path: str) -> dict:
    """The kvstore spec of folder `path` inside `kvstore`."""
    store = dict(kvstore)
    store["path"] = store.get("path", "").rstrip("/") + "/" + path + "/" if store.get("path") else path + "/"
    return store


def _array_spec(kvstore: dict, path: str, shape: list, chunk: list, dtype: str) -> dict:
    store = _under(kvstore, path)
    return {
        "driver": "zarr3",
        "kvstore": store,
        "metadata": {
            "shape": shape,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
            "chunk_key_encoding": {"name": "default"},
            "data_type": dtype,
            "fill_value": 0,
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        },
    }


def make_context(direct_io: bool = False, context: ts.Context | None = None) -> ts.Context:
    """A TensorStore context without a chunk cache (reads must reach the disk), O_DIRECT when asked."""
    if context is not None:
        return context
    spec = {"cache_pool": {"total_bytes_limit": 0}, "file_io_sync": True,
            "file_io_concurrency": {"limit": 32}}
    if direct_io:
        spec["file_io_mode"] = {"mode": "direct"}
    return ts.Context(spec)


class KVArrays:
    """The two TensorStore arrays of a store; reads of chunk runs go through its disk's `ReadScheduler`."""

    def __init__(self, kvstore: dict, layout: Layout, context: ts.Context, *, create: bool,
                 disk_bandwidth: float | None = None, max_inflight_bytes: int | None = None):
        self.layout = layout
        self.context = context
        c, lay = layout.chunk_tokens, layout
        slots = MAX_CHUNKS * c
        mode = {"create": True, "open": True} if create else {"open": True}
        kv_spec = _array_spec(kvstore, "kv", [lay.num_layers, 2, lay.kv_heads, slots, lay.head_dim],
                              [1, 1, lay.kv_heads, c, lay.head_dim], lay.dtype)
        kv_future = ts.open(kv_spec, context=context, **mode)
        probe_future = None
        if lay.probe_heads:
            probe_spec = _array_spec(kvstore, "probe", [lay.num_layers, lay.probe_heads, slots, lay.head_dim],
                                     [1, lay.probe_heads, c, lay.head_dim], lay.dtype)
            probe_future = ts.open(probe_spec, context=context, **mode)
        self._kv = kv_future.result()
        self._probe = probe_future.result() if probe_future is not None else None
        # the chunk files of both arrays, read raw (zarr3's default key encoding: "<array>/c/<i>/<j>/...")
        self._files = {kind: ts.KvStore.open(_under(kvstore, "probe" if kind == PROBE else "kv"),
                                             context=context).result() for kind in layout.kinds()}
        self.scheduler = ReadScheduler(max_inflight_bytes=max_inflight_bytes, bytes_per_s=disk_bandwidth)

    def _view(self, layer: int, kind: int, first_slot: int, last_slot: int):
        if kind == PROBE:
            return self._probe[layer, :, first_slot:last_slot]
        return self._kv[layer, kind, :, first_slot:last_slot]

    def _chunk_key(self, layer: int, kind: int, chunk: int) -> bytes:
        return (f"c/{layer}/0/{chunk}/0" if kind == PROBE else f"c/{layer}/{kind}/0/{chunk}/0").encode()

    def read_run(self, layer: int, kind: int, first_chunk: int, n_chunks: int, *, speculative: bool = False,
                 background: bool = False, head_parts: int = 1) -> Read:
        """Queue one read of `n_chunks` adjacent chunks (at the scheduler's priority `speculative` / `background`);
        its future resolves with their arrays, each `[heads, chunk_tokens, head_dim]`, once the scheduler has issued
        it and (on an emulated disk) its bytes have crossed the link. It fails if a chunk file has the wrong size; a
        missing file reads as zeros (zarr's fill value).

        `head_parts` > 1: each chunk file is read as that many byte ranges of equal head counts, one per device of a
        tensor-parallel mesh (a chunk file holds its heads one after another), as each device's reader would read
        its own heads; the parts are joined in head order."""
        files = self._files[kind]
        keys = [self._chunk_key(layer, kind, first_chunk + j) for j in range(n_chunks)]
        part = self.layout.heads(kind) // head_parts * self.layout.head_chunk_nbytes()
        ranges = [None] if head_parts == 1 else [slice(i * part, (i + 1) * part) for i in range(head_parts)]

        def issue() -> concurrent.futures.Future:
            reads = [files.read(key, byte_range=r) for key in keys for r in ranges]
            return when_all(reads, lambda results: [
                self._decode(kind, key, results[j * len(ranges):(j + 1) * len(ranges)], ranges)
                for j, key in enumerate(keys)])

        return self.scheduler.submit(Read(issue, n_chunks * self.layout.chunk_nbytes(kind), speculative, background))

    def _decode(self, kind: int, key: bytes, results: list, ranges: list) -> np.ndarray:
        """A chunk `[heads, chunk_tokens, head_dim]` from the reads of its file's byte `ranges` (None: whole)."""
        lay = self.layout
        shape = (lay.heads(kind), lay.chunk_tokens, lay.head_dim)
        if all(r.state == "missing" for r in results):
            return np.zeros(shape, lay.np_dtype)
        for result, byte_range in zip(results, ranges):
            want = lay.chunk_nbytes(kind) if byte_range is None else byte_range.stop - byte_range.start
            if len(result.value) != want:
                where = "" if byte_range is None else f" at bytes {byte_range.start}..{byte_range.stop}"
                raise ValueError(f"chunk file {KIND_NAMES[kind]}/{key.decode()} holds {len(result.value)} bytes"
                                 f"{where}, expected {want}")
        data = results[0].value if len(results) == 1 else b"".join(r.value for r in results)
        return np.frombuffer(data, lay.np_dtype).reshape(shape)

    def write_range(self, layer: int, kind: int, first_chunk: int, data: np.ndarray):
        """Write `[heads, n_chunks * chunk_tokens, head_dim]` at `first_chunk`; the future resolves when durable."""
        start = first_chunk * self.layout.chunk_tokens
        return self._view(layer, kind, start, start + data.shape[1]).write(data)

    def delete_range(self, first_chunk: int, n_chunks: int) -> None:
        """Drop the chunk files of a slot range in every layer (writing the fill value removes them)."""
        c = self.layout.chunk_tokens
        start, stop = first_chunk * c, (first_chunk + n_chunks) * c
        futures = [self._kv[:, :, :, start:stop].write(0)]
        if self._probe is not None:
            futures.append(self._probe[:, :, start:stop].write(0))
        for f in futures:
            f.result()

    def stored_chunk_ids(self, kvstore: ts.KvStore) -> set[int]:
        """Chunk indices that have any file under `kv/c/` (used to find orphans of crashed inserts)."""
        ids = set()
        for key in kvstore.list(ts.KvStore.KeyRange(b"kv/c/", b"kv/c0")).result():
            parts = key.decode().split("/")
            if len(parts) == 7:  # kv/c/layer/kv/head/chunk/dim
                ids.add(int(parts[5]))
        return ids
