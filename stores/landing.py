"""Where reads land: page-aligned host buffers that stay faulted in and are used again (`LandingBuffers`), and reads
of a local store's extent files straight into them with `preadv` (`LocalFiles`), the GIL released while the disk
works. Once a device pool is made on an accelerator whose runtime registers host memory for DMA (`PjRtClient.dma_map`:
CUDA's page-locked memory; `LandingBuffers.enable_dma`), every buffer mapped from then on is registered once, so a
take's host rows and a read's landing buffer cross to the device in one DMA from where they lie, not through the
runtime's own staging copy of pageable memory ($SPECJAX_DMA_MAP=off leaves them pageable). Tools that only read the
store (fsck) never start an accelerator's runtime.

Why not TensorStore's kvstore read for local files: its result is a Python `bytes` object, built with the GIL held,
that the engine then copies into its aligned buffer; each copy of fresh memory also faults its pages in, several
times slower than a copy into memory already faulted in. On a large model's KV that host work can take longer than
the disk (`benchmarks/data_path.py`, `benchmarks/results/cpu/data_path`), and it holds the GIL for milliseconds at a
time while the request's thread waits to compute. A `preadv` into a buffer already faulted in copies nothing on
the host (with O_DIRECT the disk writes the buffer) and holds no lock a computing thread needs. TensorStore still
writes, lists and deletes every extent, and reads those of any other kvstore (memory, ocdbt, cloud).
"""

from __future__ import annotations

import collections
import concurrent.futures
import mmap
import os
import threading
import weakref

import jax
import numpy as np

ALIGN = 4096  # O_DIRECT: offsets, lengths and buffer addresses on this boundary
KEEP_BYTES = 2 << 30  # free landing buffers kept for reuse at most (more are unmapped when released)
READ_THREADS = 32  # preadv calls in flight at most, over every store of the process (the scheduler bounds bytes)
DMA_ENV = "SPECJAX_DMA_MAP"  # "off": landing buffers stay pageable memory on an accelerator too


def _size_class(nbytes: int) -> int:
    """`nbytes` rounded up to a step of 1/8 of its power of two (and at least one page): few sizes, <= 12.5% spare."""
    nbytes = max(int(nbytes), ALIGN)
    step = max(ALIGN, 1 << max(0, nbytes.bit_length() - 4))
    return -(-nbytes // step) * step


def dma_client(choice: str | None = None):
    """The default backend's client where it registers host memory for DMA (a GPU's), else None: a CPU device reads
    host memory in place, and $SPECJAX_DMA_MAP=off (or `choice="off"`) asks for pageable buffers."""
    choice = (os.environ.get(DMA_ENV, "on") if choice is None else choice).strip().lower() or "on"
    if choice not in ("on", "off"):
        raise ValueError(f"${DMA_ENV}={choice!r} is not 'on' or 'off'; unset it or pick one.")
    if choice == "off" or jax.default_backend() == "cpu":
        return None
    client = jax.devices()[0].client
    return client if hasattr(client, "dma_map") else None


class LandingBuffers:
    """Page-aligned host buffers that reads land in, faulted in once and used again.

    `empty(shape, dtype)` lends an uninitialised array on a page boundary. It goes back to the free list when the last
    reference to it or to any view of it is gone (a CPU device that aliased it holds one until its own array is
    freed), so a buffer is never written while anything can still read it. At most `keep_bytes` of free buffers are
    kept. After `enable_dma()` each buffer mapped is registered for DMA with the accelerator's runtime and
    unregistered before it is unmapped (`pinned_for_dma`); `close()` unregisters the free ones and drops them."""

    def __init__(self, keep_bytes: int = KEEP_BYTES):
        self.keep_bytes = keep_bytes
        self._client = None  # the runtime that registers buffers (`enable_dma`), or None
        self._registered: set[int] = set()  # addresses of the buffers registered with it
        self._refused = False  # it refused one: later buffers stay pageable
        self._free: dict[int, list[mmap.mmap]] = collections.defaultdict(list)
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.stats = {"lent": 0, "reused": 0, "mapped_bytes": 0, "dma_mapped_bytes": 0}

    @property
    def pinned_for_dma(self) -> bool:
        """Are new buffers registered for DMA?"""
        return bool(self._client) and not self._refused

    def enable_dma(self, choice: str | None = None) -> bool:
        """Register the buffers mapped from now on with the default backend's runtime where it registers host memory
        (`dma_client(choice)`: a GPU's, unless $SPECJAX_DMA_MAP or `choice` is "off"); returns whether it does. Called
        by what has started the device (`stores.pool.DevicePool`), so that the store alone never starts it."""
        if self._client is None:
            self._client = dma_client(choice)
        return self.pinned_for_dma

    def close(self) -> None:
        """Unregister and drop the free buffers (those lent are unregistered when they come back)."""
        with self._lock:
            free = [buf for bufs in self._free.values() for buf in bufs]
            self._free.clear()
            self._free_bytes = 0
            self.stats["mapped_bytes"] -= sum(len(buf) for buf in free)
        for buf in free:
            self._unregister(buf, len(buf))

    def _register(self, buf: mmap.mmap, size: int) -> None:
        if self.pinned_for_dma:
            try:
                self._client.dma_map(_address(buf), size)
            except Exception as e:  # noqa: BLE001 -- the runtime refused: buffers stay pageable, said once
                self._refused = True
                print(f"[specjax.landing] host buffers stay pageable: registering one for DMA failed ({e})")
                return
            with self._lock:
                self._registered.add(_address(buf))
                self.stats["dma_mapped_bytes"] += size

    def empty(self, shape: tuple, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        size = _size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            buf = free.pop() if free else None
            if buf is not None:
                self._free_bytes -= size
            self.stats["lent"] += 1
            self.stats["reused"] += buf is not None
        if buf is None:
            buf = mmap.mmap(-1, size)  # anonymous: page-aligned
            np.frombuffer(buf, np.uint8)[::mmap.PAGESIZE] = 0  # fault every page in now, once
            self._register(buf, size)
            with self._lock:
                self.stats["mapped_bytes"] += size
        flat = np.frombuffer(buf, np.uint8, nbytes)  # its views keep it alive (numpy's base stops at it)
        weakref.finalize(flat, self._give_back, buf, size)
        return flat.view(dtype).reshape(shape)

    def _give_back(self, buf: mmap.mmap, size: int) -> None:
        with self._lock:
            if self._free_bytes + size <= self.keep_bytes:
                self._free[size].append(buf)
                self._free_bytes += size
                return
            self.stats["mapped_bytes"] -= size
        self._unregister(buf, size)
        # unmapped when `buf` is collected (this frame's reference is its last)

    def _unregister(self, buf: mmap.mmap, size: int) -> None:
        address = _address(buf)
        with self._lock:
            registered = address in self._registered
            self._registered.discard(address)
            if registered:
                self.stats["dma_mapped_bytes"] -= size
        if registered:
            try:
                self._client.dma_unmap(address)
            except Exception:  # noqa: BLE001 -- the runtime is gone (interpreter exit): nothing left to unregister
                pass

    @property
    def free_bytes(self) -> int:
        return self._free_bytes


def _address(buf: mmap.mmap) -> int:
    return np.frombuffer(buf, np.uint8, 1).ctypes.data


BUFFERS = LandingBuffers()  # one per process: every store's reads land in it

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _read_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="specjax-disk")
        return _pool


class LocalFiles:
    """Byte ranges of the files under a local directory, read with `preadv` straight into host buffers, on the
    process's disk threads; O_DIRECT when `direct` (a range or buffer off the 4 KiB boundary is read as the aligned
    range around it into a landing buffer, then copied)."""

    def __init__(self, root: str, direct: bool):
        self.root, self.direct = root, direct

    def path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def read(self, key: str, ranges: list[slice], out: np.ndarray) -> concurrent.futures.Future:
        """Future of `out` once the byte `ranges` of file `key`, one after another, fill it (`out`: C-contiguous,
        as many bytes as the ranges). It fails with FileNotFoundError if the file is missing and ValueError if it
        is shorter than a range."""
        return _read_pool().submit(self._read, key, ranges, out)

    def read_many(self, reads: list[tuple[str, list[slice], list[int], np.ndarray]]) -> concurrent.futures.Future:
        """`read` of several (key, ranges, where each range lands in out's bytes, out), one after another on one disk
        thread: a future of the list of their results, each its `out` or the exception its read raised (the others
        are read all the same)."""
        return _read_pool().submit(self._read_many, reads)

    def _read_many(self, reads) -> list:
        results = []
        for key, ranges, lands, out in reads:
            try:
                results.append(self._read(key, ranges, out, lands))
            except Exception as e:  # noqa: BLE001 -- this read's failure, delivered with the others' data
                results.append(e)
        return results

    def _read(self, key: str, ranges: list[slice], out: np.ndarray, lands: list[int] | None = None) -> np.ndarray:
        """`ranges` of the file into `out`'s bytes: each at its offset in `lands` (default: one after another)."""
        if lands is None:
            lands = np.cumsum([0] + [r.stop - r.start for r in ranges[:-1]]).tolist()
        dest = out.reshape(-1).view(np.uint8)
        fd = os.open(self.path(key), os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if self.direct else 0))
        try:
            for r, at in zip(ranges, lands):
                self._read_range(fd, key, r.start, dest[at:at + r.stop - r.start])
        finally:
            os.close(fd)
        return out

    def _read_range(self, fd: int, key: str, offset: int, dest: np.ndarray) -> None:
        n = len(dest)
        if not self.direct or (offset % ALIGN == 0 and n % ALIGN == 0 and dest.ctypes.data % ALIGN == 0):
            got = _pread_full(fd, dest, offset, self.direct)
        else:  # O_DIRECT needs the aligned range around it
            lo = offset - offset % ALIGN
            span = -(-(offset + n - lo) // ALIGN) * ALIGN
            bounce = BUFFERS.empty((span,), np.uint8)
            got = max(0, _pread_full(fd, bounce, lo, True) - (offset - lo))
            got = min(got, n)
            dest[:got] = bounce[offset - lo:offset - lo + got]
        if got != n:
            raise ValueError(f"extent kv/{key} holds {offset + got} bytes, a read of {offset}..{offset + n} "
                             f"needs {offset + n}")


def _pread_full(fd: int, dest: np.ndarray, offset: int, direct: bool) -> int:
    """Read into all of `dest` from `offset`, as many `preadv`s as it takes; returns the bytes read (fewer at EOF:
    with O_DIRECT a read that ends off the boundary ended at EOF)."""
    view = memoryview(dest)
    total = 0
    while total < len(dest):
        got = os.preadv(fd, [view[total:]], offset + total)
        total += got
        if got == 0 or (direct and total % ALIGN):
            break
    return total
