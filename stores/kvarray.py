"""The on-disk KV and probe-key arrays (TensorStore zarr3), chunk reads as futures, O_DIRECT and bandwidth emulation.

Layout: `kv[layer, kv(2), kv_head, slot, head_dim]` and `probe[layer, probe_head, slot, head_dim]`, one storage
chunk per `chunk_tokens` slots, so a read of (layer, K|V|probe, chunk) touches exactly one file.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time

import numpy as np
import tensorstore as ts

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


@dataclasses.dataclass(eq=False)
class _Transfer:
    key: tuple              # (layer, kind, chunk)
    speculative: bool
    future: object = None   # what the reader waits on
    nbytes: int = 0
    deliver: object = None  # called once the bytes have crossed the link
    queued: bool = False
    withdrawn: bool = False  # speculative and no longer wanted: never crosses the link
    sent_at: float = 0.0     # monotonic time it reached the link's queue


class DiskLink:
    """An emulated disk link of `bytes_per_s` that moves one chunk at a time, back to back: demand reads first,
    speculative reads only while no demand read waits, first come first served within each class.

    A speculative read that becomes needed while it waits (`expedite`) joins the demand queue; one nobody wants
    any more (`withdraw`) leaves the queue without crossing the link, as a read held in a host-side submission
    queue is never issued. A transfer already on the link is never interrupted (a chunk takes tens of
    microseconds to milliseconds).
    """

    def __init__(self, bytes_per_s: float):
        if bytes_per_s <= 0:
            raise ValueError(f"disk bandwidth must be > 0 bytes/s, got {bytes_per_s}")
        self.bytes_per_s = float(bytes_per_s)
        self._demand: collections.deque = collections.deque()
        self._speculative: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kv-disk-link", daemon=True)
        self._thread.start()

    def send(self, transfer: _Transfer, nbytes: int, deliver) -> bool:
        """Queue the transfer; False if it was withdrawn before it got here (nothing will be delivered)."""
        with self._cv:
            transfer.nbytes, transfer.deliver = nbytes, deliver
            if transfer.withdrawn:
                return False
            transfer.queued, transfer.sent_at = True, time.monotonic()
            (self._speculative if transfer.speculative else self._demand).append(transfer)
            self._cv.notify()
            return True

    def withdraw(self, transfer: _Transfer) -> bool:
        """Drop a speculative transfer that has not started. True if it left the queue here; one not sent yet
        is marked so that `send` refuses it; one on the link or delivered is left alone."""
        with self._cv:
            if not transfer.speculative:
                return False
            if transfer.queued:
                self._speculative.remove(transfer)
                transfer.queued, transfer.withdrawn = False, True
                return True
            if transfer.deliver is None:
                transfer.withdrawn = True
            return False

    def expedite(self, transfer: _Transfer) -> None:
        with self._cv:
            if transfer.speculative and transfer.queued:
                self._speculative.remove(transfer)
                self._demand.append(transfer)
            transfer.speculative = False

    def _run(self):
        free_at = 0.0
        while True:
            with self._cv:
                while not (self._demand or self._speculative):
                    self._cv.wait()
                transfer = (self._demand or self._speculative).popleft()
                transfer.queued = False
            # It starts when both it and the link were ready, not when this thread got to it: time spent in the
            # previous delivery's callbacks does not leave the emulated link idle.
            free_at = max(transfer.sent_at, free_at) + transfer.nbytes / self.bytes_per_s
            delay = free_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            transfer.deliver()


def _array_spec(kvstore: dict, path: str, shape: list, chunk: list, dtype: str) -> dict:
    store = dict(kvstore)
    store["path"] = store.get("path", "").rstrip("/") + "/" + path + "/" if store.get("path") else path + "/"
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
    """The two TensorStore arrays of a store; reads return concurrent futures, optionally throttled."""

    def __init__(self, kvstore: dict, layout: Layout, context: ts.Context, *, create: bool,
                 disk_bandwidth: float | None = None):
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
        self.link = DiskLink(disk_bandwidth) if disk_bandwidth else None
        self._in_flight: dict = {}  # key -> transfers not yet delivered (emulated link only)
        self._lock = threading.Lock()

    def _view(self, layer: int, kind: int, first_slot: int, last_slot: int):
        if kind == PROBE:
            return self._probe[layer, :, first_slot:last_slot]
        return self._kv[layer, kind, :, first_slot:last_slot]

    def read_chunk(self, layer: int, kind: int, chunk: int, *, speculative: bool = False) -> concurrent.futures.Future:
        """Future of the chunk as `[heads, chunk_tokens, head_dim]`. On an emulated disk (`disk_bandwidth`) it
        resolves once the chunk has crossed the link, where a speculative read yields to demand reads."""
        c = self.layout.chunk_tokens
        out: concurrent.futures.Future = concurrent.futures.Future()
        transfer = _Transfer((layer, kind, chunk), speculative, out)
        if self.link is not None:
            with self._lock:
                self._in_flight.setdefault(transfer.key, []).append(transfer)
        ts_future = self._view(layer, kind, chunk * c, (chunk + 1) * c).read()

        def done(f):
            try:
                array = f.result()
            except BaseException as e:  # noqa: BLE001 -- any read failure is the caller's miss
                self._landed(transfer)
                out.set_exception(e)
                return
            if self.link is None:
                out.set_result(array)
                return

            def deliver():
                self._landed(transfer)
                out.set_result(array)

            if not self.link.send(transfer, array.nbytes, deliver):  # withdrawn while the disk read ran
                self._landed(transfer)
                out.cancel()

        ts_future.add_done_callback(done)
        return out

    def expedite(self, layer: int, kind: int, chunk: int) -> None:
        """The chunk's speculative reads in flight are needed now: on an emulated link they join the demand queue."""
        if self.link is None:
            return
        with self._lock:
            transfers = list(self._in_flight.get((layer, kind, chunk), ()))
        for transfer in transfers:
            self.link.expedite(transfer)

    def withdraw(self, layer: int, kind: int, chunk: int) -> None:
        """The chunk's speculative reads are not wanted any more: on an emulated link, those that have not
        started never cross it, and their futures are cancelled."""
        if self.link is None:
            return
        with self._lock:
            transfers = list(self._in_flight.get((layer, kind, chunk), ()))
        for transfer in transfers:
            if self.link.withdraw(transfer):
                self._landed(transfer)
                transfer.future.cancel()

    def _landed(self, transfer: _Transfer) -> None:
        if self.link is None:
            return
        with self._lock:
            pending = self._in_flight.get(transfer.key, [])
            if transfer in pending:
                pending.remove(transfer)
            if not pending:
                self._in_flight.pop(transfer.key, None)

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
