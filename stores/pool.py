"""The cache tiers' memory: store chunks as pages of one fixed-shape array per tier and page key, as paged
attention keeps its KV blocks, and takes that read tokens out of them through a block table. The device tier's pages
are a device array (`DevicePool`); the host tier's a host array (`HostPages`), which a device that reads host memory
(a CPU device) reads in place.

One page array per page key (`Layout.page_key`: a head count, a row width and an element type; K/V pages, probe pages
where the probe heads are fewer, pages of each low precision the store holds): `[slots, heads, chunk_tokens, width]`
holding the kind's bits as unsigned integers of its width (XLA:CPU scatters bfloat16 by converting the whole operand,
a write far slower than the same write as uint16, `benchmarks/pool_write.py`; a take's gather turns the rows it reads
back), allocated once with as many slots as the device tier's budget holds chunks of
that key (so with two page keys the device holds up to twice the budget). `TieredCache` decides what the tier keeps
and tells the pool (`placed` / `removed`); the pool gives each kept chunk a slot and writes it there, with every other
page placed since, in one batched copy: when the request that placed it ends (`flush`, after its first token), or at
the next take that reads the array if that comes first.

A take is then at most three device steps however many chunks it touches: that write, one copy of the rows no
page array of the device holds (read from disk, and host-cache hits where the device does not read host memory; only
those rows, in an array of a quarter, half, three quarters or all of the take's size, `staged_size`, or a whole
layer's landing buffer as it is, `gather_extent`), and one gather of the take's tokens, each row from its chunk's slot
and offset (the block table) or from those copied rows. Shapes come from fixed buckets (pages written per step,
tokens per take, parts of a take), so a take of a size seen before compiles nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import mmap
import threading

import jax
import jax.numpy as jnp
import numpy as np

from specjax.shapes import bucket, padded
from specjax.stores.kvarray import Layout
from specjax.stores.landing import BUFFERS
from specjax.stores.metrics import StoreMetrics
from specjax.stores.scheduler import Link

MAX_WRITE_PAGES = 64  # pages one write step moves (more go in further steps of the same take)
WRITE_BUCKETS = sorted({bucket(n, minimum=1) for n in range(1, MAX_WRITE_PAGES + 1)})  # <= 25% padding crosses


def pages_in(layout: Layout, key: tuple, budget_bytes: int) -> int:
    """How many whole chunks of page key `key` (heads, width, element type: `Layout.page_key`) `budget_bytes` hold: a
    page array's slots."""
    heads, width, itemsize = key
    return int(budget_bytes) // (heads * layout.chunk_tokens * width * itemsize)


def page_dtype(dtype) -> np.dtype:
    """The unsigned integer type of `dtype`'s width: the page arrays' element type."""
    return np.dtype(f"uint{np.dtype(dtype).itemsize * 8}")


@functools.partial(jax.jit, donate_argnums=0)
def write_pages(pages, slots, data):
    """pages with data[i] at slot slots[i]; slots beyond the array are padding, dropped."""
    return pages.at[slots].set(data, mode="drop")


@functools.partial(jax.jit, static_argnums=1)
def _pages_in_order(pages, size, count):
    """[heads, size, d]: the pages' rows in order (chunk after chunk), zeros from row `count` on."""
    n, heads, c, d = pages.shape
    rows = jnp.swapaxes(pages, 0, 1).reshape(heads, n * c, d)
    rows = rows[:, :size] if n * c >= size else jnp.pad(rows, ((0, 0), (0, size - n * c), (0, 0)))
    return jnp.where((jnp.arange(size) < count)[None, :, None], rows, jnp.zeros((), pages.dtype))


STAGED_PARTS = 4  # a take's host rows cross in an array of a quarter, half, three quarters or all of its size


def staged_size(size: int, rows: int) -> int:
    """The rows of the host array that carries `rows` of a take of `size` rows to the device: the next multiple of
    a quarter of `size` (sizes are buckets, multiples of 16), so a take compiles one gather per part."""
    part = max(1, size // STAGED_PARTS)
    return min(size, -(-max(rows, 1) // part) * part)


def staging(shape: tuple, dtype, n: int, buffers=BUFFERS) -> np.ndarray:
    """The host rows `[heads, size, d]` of a take of `n` tokens: a landing buffer of `buffers` (page-aligned and
    faulted in once, `stores.landing`; a CPU device aliases it rather than copy it), zeros after row n. Rows the take
    fills from the device's pages are left as they are: the gather does not read them. (A fresh `np.zeros` would fault
    its pages in as it is written and cross as one more copy, a slower take: `benchmarks/results/cpu/host-exposed`.)"""
    staged = buffers.empty(shape, dtype)
    staged[:, n:] = 0
    return staged


def copy_rows(out: np.ndarray, rows: np.ndarray, chunks: np.ndarray, index: np.ndarray, offsets: np.ndarray) -> None:
    """out[:, rows[i]] = chunks[index[i], :, offsets[i]] (`out` [heads, size, d], `chunks` [n, heads, c, d]): each
    head's row copied as one opaque element of d values' bytes, not value by value (reads land contiguous: no copy
    of `chunks` here)."""
    heads, size, d = out.shape
    chunks = np.ascontiguousarray(chunks)
    row = np.dtype((np.void, d * out.itemsize))
    c = chunks.shape[2]
    src = (index[None, :] * heads + np.arange(heads)[:, None]) * c + offsets[None, :]
    dst = np.arange(heads)[:, None] * size + rows[None, :]
    out.reshape(heads * size, d).view(row)[dst, 0] = chunks.reshape(-1, d).view(row)[src, 0]



@functools.partial(jax.jit, static_argnames="dtype")
def _gather(pages, table, staged, host=None, dtype=None):
    """[heads, size, d] of staged's dtype (or `dtype` where staged is None): with (slot, offset, j, h) = table[:, i],
    row i from pages[slot, :, offset] where slot >= 0, else host[h, :, offset] where h >= 0, else staged[:, j] where
    j >= 0, else zeros (made inside the step: a zeros array of the take's size made by a step of its own cost a CPU
    device as much as the gather). `staged` [heads, <= size, d] holds only the rows in neither page array, or is
    None; `host` is the host tier's page array where the device reads host memory (`HostPages.on_device`), or None.
    `pages` and `host` may hold the bits of that dtype (the pools' page arrays)."""
    dtype = dtype if staged is None else staged.dtype
    slots, offsets, index, host_slots = table[0], table[1], table[2], table[3]
    rows_of = lambda array, at: jax.lax.bitcast_convert_type(  # noqa: E731
        jnp.swapaxes(array[jnp.maximum(at, 0), :, offsets], 0, 1), dtype)
    out = jnp.zeros((), dtype)
    if staged is not None:
        out = jnp.where((index >= 0)[None, :, None], staged[:, jnp.maximum(index, 0)], out)
    if host is not None:
        out = jnp.where((host_slots >= 0)[None, :, None], rows_of(host, host_slots), out)
    return jnp.where((slots >= 0)[None, :, None], rows_of(pages, slots), out)


@functools.partial(jax.jit, static_argnames="dtype")
def _gather_rows(pages, host, table, rows, count, when, dtype=None):
    """[heads, size, d] (size = len(rows)): row i is row rows[i] of a block table of every position of a layer
    (`table` [4, positions], as `_gather`'s) for i < `count`, zeros after; and `when` and whether every one of those
    rows lies in a page (device pages, or host pages where the device reads them). The rows are chosen on the device:
    the host never reads them before the gather."""
    valid = jnp.arange(rows.shape[0]) < count
    picked = jnp.where(valid[None], jnp.take(table, rows, axis=1, mode="fill", fill_value=-1), -1)
    found = (picked[0] >= 0) | (picked[3] >= 0)
    picked = picked.at[1].set(jnp.maximum(picked[1], 0))
    return _gather(pages, picked, None, host, dtype=dtype), when & jnp.all(found | ~valid)


@dataclasses.dataclass(eq=False)
class _Pages:
    """The page array of one page key, and which chunk each slot holds."""
    array: jax.Array
    free: list
    slot_of: dict = dataclasses.field(default_factory=dict)       # key -> slot
    pending: dict = dataclasses.field(default_factory=dict)       # slot -> host chunk to write at the next take
    pinned: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # slot -> takes reading
    released: set = dataclasses.field(default_factory=set)        # pinned slots whose chunk left the tier
    unslotted: dict = dataclasses.field(default_factory=dict)     # key -> chunk kept by the tier, no slot free yet


class DevicePool:
    """The device tier's pages (`placed`/`removed` from TieredCache) and the takes that read them (`gather`)."""

    copies_out = False  # the tier keeps each chunk's host copy itself: what leaves it is that copy

    def __init__(self, layout: Layout, gpu_cache_bytes: int, *, metrics: StoreMetrics | None = None,
                 pcie_bandwidth: float | None = None, device: jax.Device | None = None):
        """`gpu_cache_bytes`: the device tier's budget, which sizes the page arrays."""
        self.layout = layout
        self.metrics = metrics if metrics is not None else StoreMetrics()
        self.pcie = Link(pcie_bandwidth) if pcie_bandwidth else None
        # None: the default device, arrays left uncommitted (a committed array gives every jitted step that touches
        # it a second executable for the same shapes)
        self.device = device
        BUFFERS.enable_dma()  # the device is up: host buffers made from now on cross it in one DMA where they can
        self._lock = threading.Lock()  # the slots' bookkeeping (the tier decides from any thread)
        self._device_lock = threading.Lock()  # the page arrays (a take's writes and gather, from Cake's loader too)
        self._pages: dict[tuple, _Pages] = {}
        c = layout.chunk_tokens
        for key in sorted({layout.page_key(kind) for kind in layout.kinds()}):
            slots = pages_in(layout, key, gpu_cache_bytes)
            # one slot more than the budget holds: never given out, so a gather never indexes an empty array
            array = jax.device_put(np.zeros((slots + 1, key[0], c, key[1]), page_dtype(layout.page_dtype(key))), device)
            self._pages[key] = _Pages(array, list(range(slots - 1, -1, -1)))
        self._compiled: set = set()
        self.host_pages: HostPages | None = None  # the host tier's pages, which takes may read in place

    def _of(self, key) -> _Pages:
        return self._pages[self.layout.page_key(key[1])]

    # -- the device tier's decisions (any thread) --------------------------------------------------------------

    def placed(self, key, chunk: np.ndarray) -> None:
        """The tier keeps `key` (layer, kind, chunk id): give it a slot, written at the next take."""
        with self._lock:
            pages = self._of(key)
            if pages.free:
                slot = pages.free.pop()
                pages.slot_of[key] = slot
                pages.pending[slot] = chunk
            else:  # every slot free by budget is still read by a take: placed when one is released
                pages.unslotted[key] = chunk

    def removed(self, key) -> None:
        """The tier dropped `key`: its slot is free once no take reads it."""
        with self._lock:
            pages = self._of(key)
            if pages.unslotted.pop(key, None) is not None:
                return
            slot = pages.slot_of.pop(key)
            if slot in pages.pinned:
                pages.released.add(slot)  # a pending write stays: the take that pinned it reads it
            else:
                pages.pending.pop(slot, None)
                self._free(pages, slot)

    def _free(self, pages: _Pages, slot: int) -> None:
        if pages.unslotted:
            key, chunk = next(iter(pages.unslotted.items()))
            del pages.unslotted[key]
            pages.slot_of[key] = slot
            pages.pending[slot] = chunk
        else:
            pages.free.append(slot)

    # -- takes (the engine's thread) ------------------------------------------------------------------------

    def pin(self, key) -> int | None:
        """The slot holding `key` for a take (None: not on the device): `pin_many` of one chunk."""
        slot = int(self.pin_many([key])[0])
        return None if slot < 0 else slot

    def pin_many(self, keys) -> np.ndarray:
        """The slots holding chunks of one page key for a take, under one lock: int64, -1 where a chunk is not on
        the device. Each stays its chunk's until the take `unpin`s it, whatever the tier decides meanwhile."""
        if not keys:
            return np.full(0, -1, np.int64)
        with self._lock:
            pages = self._of(keys[0])
            out = np.fromiter(map(pages.slot_of.get, keys, itertools.repeat(-1)), np.int64, len(keys))
            pages.pinned.update(out[out >= 0].tolist())
        return out

    def unpin(self, kind: int, slots) -> None:
        """A take has read `slots` (as returned by `pin`)."""
        with self._lock:
            pages = self._pages[self.layout.page_key(kind)]
            for slot in slots:
                pages.pinned[slot] -= 1
                if pages.pinned[slot] == 0:
                    del pages.pinned[slot]
                    if slot in pages.released:
                        pages.released.discard(slot)
                        pages.pending.pop(slot, None)
                        self._free(pages, slot)

    def gather(self, kind: int, slots: np.ndarray, offsets: np.ndarray, staged: np.ndarray | jax.Array | None,
               index: np.ndarray | None = None, host_slots: np.ndarray | None = None) -> jax.Array:
        """`[heads, size, d]` on the device: row i from slot slots[i] (>= 0) at offsets[i], else from slot
        host_slots[i] (>= 0) of the host tier's pages where the device reads them (`HostPages.on_device`), else row
        index[i] of `staged` (on the host or already on the device; None if no row is there), zeros where index[i]
        < 0. `staged` has `staged_size` rows; without `index` it has the take's size and row i is its row i. Pages
        placed since the last gather from this page array are written first; a take with no row in a slot is its
        host rows' one copy. Host-page rows count as crossing (`host_to_device_bytes`): they are read in place on
        a device that shares host memory, and would cross on any other."""
        pages = self._pages[self.layout.page_key(kind)]
        size = len(slots)
        if (kind, size) not in self._compiled:
            self.compile(kind, size)
        if isinstance(staged, np.ndarray):
            staged = self._to_device(staged)
        host = self._host_array(kind)
        from_host = 0 if host_slots is None else int((host_slots >= 0).sum())
        if staged is not None and staged.shape[1] == size and index is None and not (slots >= 0).any() \
                and not from_host:
            return staged
        self.count_host_rows(kind, from_host)
        table = np.stack([slots, offsets, np.arange(size) if index is None else index,
                          np.full(size, -1) if host_slots is None else host_slots]).astype(np.int32)
        with self._device_lock:
            self._write_pending(pages)
            return _gather(pages.array, table, staged, host, dtype=self.layout.dtype_of(kind))

    def gather_rows(self, kind: int, table: np.ndarray, rows: jax.Array, count, when) -> tuple[jax.Array, jax.Array]:
        """(`[heads, len(rows), d]`, `when` and whether every row was in a page) on the device: row i is the row that
        block table `table` (`[4, positions]`: slot, offset, unused, host slot per position of a layer; -1 where a
        position is in no page the device reads) gives position rows[i], for i < `count` (device scalars or host
        ints), zeros after. `rows` may still be being computed: nothing here waits for it. Pages placed since the last
        gather from this page array are written first; the caller pins the slots the table names until it is done."""
        pages = self._pages[self.layout.page_key(kind)]
        with self._device_lock:
            self._write_pending(pages)
            return _gather_rows(pages.array, self._host_array(kind), table, rows, count, when,
                                dtype=self.layout.dtype_of(kind))

    def count_host_rows(self, kind: int, rows: int) -> None:
        """A take's `rows` from the host tier's pages, read in place by the device: they count as crossing (one
        transfer), as they would on a device that does not share host memory."""
        if rows:
            self.metrics.add(host_to_device_bytes=rows * self.layout.token_nbytes(kind), host_to_device_transfers=1)

    def readable(self, kind: int) -> bool:
        """Can a take of `kind` find rows in a page the device reads (a device tier with slots, or host pages read
        in place)?"""
        return self._pages[self.layout.page_key(kind)].array.shape[0] > 1 or self._host_array(kind) is not None

    def _host_array(self, kind: int) -> jax.Array | None:
        """The host tier's page array of `kind` as the device reads it, or None (`HostPages.on_device`)."""
        return None if self.host_pages is None else self.host_pages.on_device(kind)

    def gather_extent(self, kind: int, extent: np.ndarray, table: np.ndarray) -> jax.Array:
        """`[heads, size, d]` on the device from a host buffer of whole chunks `[n, heads, chunk_tokens, d]` (pages:
        one read's landing buffer): the buffer crosses in one copy (none on a CPU device, which aliases an aligned
        buffer) and the device gathers row i from chunk table[0, i] at offset table[1, i] (zeros where < 0)."""
        count = int((table[0] >= 0).sum())
        c = self.layout.chunk_tokens
        stored_order = np.arange(count)
        if (table[0, :count] == stored_order // c).all() and (table[1, :count] == stored_order % c).all():
            return _pages_in_order(self._to_device(extent), table.shape[1], count)  # no gather: a reshape
        table = np.concatenate([table, np.full((2, table.shape[1]), -1, np.int32)])
        return _gather(self._to_device(extent), table, None, dtype=extent.dtype)

    def flush(self) -> None:
        """Write every page placed since the last take now (after a request's first token), not at the next take."""
        with self._device_lock:
            for pages in self._pages.values():
                self._write_pending(pages)

    def _write_pending(self, pages: _Pages) -> None:
        """Every page placed since the last take, in one host->device copy per MAX_WRITE_PAGES."""
        with self._lock:
            pending, pages.pending = pages.pending, {}
        items = list(pending.items())
        for i in range(0, len(items), MAX_WRITE_PAGES):
            part = items[i:i + MAX_WRITE_PAGES]
            n = bucket(len(part), minimum=1)
            data = np.zeros((n, *pages.array.shape[1:]), pages.array.dtype)
            for j, (_, chunk) in enumerate(part):
                data[j] = chunk.view(data.dtype)
            slots = padded(np.array([slot for slot, _ in part]), n, pages.array.shape[0])
            pages.array = write_pages(pages.array, slots.astype(np.int32), self._to_device(data, page_write=True))

    def _to_device(self, host: np.ndarray, page_write: bool = False) -> jax.Array:
        if self.pcie is not None:
            self.pcie.consume(host.nbytes)
        self.metrics.add(host_to_device_bytes=host.nbytes, host_to_device_transfers=1,
                         device_page_bytes=host.nbytes if page_write else 0)
        return jax.device_put(host, self.device)

    def compile(self, kind: int, size: int) -> None:
        """Compile a take of `size` rows of `kind` (its gather, and every write step's size), so that a later take
        of that size compiles nothing whatever the tier then holds."""
        pages = self._pages[self.layout.page_key(kind)]
        heads, d = self.layout.heads(kind), self.layout.width(kind)
        dtype = self.layout.dtype_of(kind)  # as a take's gather names it (a static argument)
        table = np.zeros((4, size), np.int32)
        part = max(1, size // STAGED_PARTS)
        staged_sizes = sorted({staged_size(size, rows) for rows in range(part, size + part, part)})
        host = self._host_array(kind)
        with self._device_lock:
            self._compile_writes(pages)
            for staged in (None, *(jax.device_put(np.zeros((heads, rows, d), dtype), self.device)
                                   for rows in staged_sizes)):
                jax.block_until_ready(_gather(pages.array, table, staged, host, dtype=dtype))
        self._compiled.add((kind, size))

    def _compile_writes(self, pages: _Pages) -> None:
        """Every write step's size for this page array, each writing nothing."""
        for n in WRITE_BUCKETS:
            if (pages.array.shape, n) not in self._compiled:
                empty = np.full(n, pages.array.shape[0], np.int32)  # every slot out of range: nothing written
                data = jax.device_put(np.zeros((n, *pages.array.shape[1:]), pages.array.dtype), self.device)
                pages.array = write_pages(pages.array, empty, data)
                self._compiled.add((pages.array.shape, n))


class HostPages:
    """The host cache tier's memory: its chunks as pages of one host array per page key (`[slots, heads,
    chunk_tokens, width]`, page-aligned and faulted in only as slots are first written), so that a take copies the
    rows of all its host hits in one indexing step (`Prefetcher.take`), not a copy of each whole chunk first.

    `TieredCache` tells it what the host tier keeps (`placed` copies the chunk into a slot and the tier keeps that
    slot's view; `removed` frees the slot; what leaves the tier is handed on as a copy, since the slot may be written
    again at once). Each array has as many slots as the tier's budget holds chunks of its page key."""

    copies_out = True

    def __init__(self, layout: Layout, cpu_cache_bytes: int, device: jax.Device | None = None):
        """`cpu_cache_bytes`: the host tier's budget, which sizes the page arrays."""
        self.layout = layout
        self._lock = threading.Lock()
        self._arrays: dict[tuple, np.ndarray] = {}  # page key -> [slots, heads, c, width] of its element type
        self._on_device: dict[tuple, jax.Array] = {}  # page key -> the same memory as the device reads it
        self._free: dict[tuple, list] = {}
        self.slot_of: dict = {}  # key -> slot (in its page key's array)
        c = layout.chunk_tokens
        for key in sorted({layout.page_key(kind) for kind in layout.kinds()}):
            slots = pages_in(layout, key, cpu_cache_bytes)
            shape, dtype = (max(slots, 1), key[0], c, key[1]), layout.page_dtype(key)
            buffer = mmap.mmap(-1, int(np.prod(shape)) * dtype.itemsize)  # anonymous: zero pages until written
            bits = np.frombuffer(buffer, page_dtype(dtype)).reshape(shape)
            self._arrays[key] = bits.view(dtype)
            self._free[key] = list(range(slots - 1, -1, -1))
            if (device or jax.devices()[0]).platform == "cpu":  # elsewhere this would copy the whole tier over
                shared = jax.device_put(bits, device)
                if shared.unsafe_buffer_pointer() == bits.ctypes.data:  # the device reads this very memory
                    self._on_device[key] = shared

    def array(self, kind: int) -> np.ndarray:
        """The page array holding `kind`'s chunks."""
        return self._arrays[self.layout.page_key(kind)]

    def on_device(self, kind: int) -> jax.Array | None:
        """`kind`'s page array as a device array over the same memory, where the device reads host memory (a CPU
        device: a take then gathers host hits' rows in place, with its device pages' rows); None elsewhere (they
        are copied into the take's host rows, which cross in one copy). Its slots are written only when the
        request that placed their chunks is over (`TieredCache.settle`, after the first token, which waited for
        every take's gather), so no gather reads a slot while it is written."""
        return self._on_device.get(self.layout.page_key(kind))

    def placed(self, key, chunk: np.ndarray) -> np.ndarray | None:
        """The tier keeps `key` (layer, kind, chunk id): its copy in a free slot, as a view (None: no slot free, the
        tier keeps `chunk` itself)."""
        heads = self.layout.page_key(key[1])
        with self._lock:
            free = self._free[heads]
            if not free:
                return None
            slot = free.pop()
            self.slot_of[key] = slot
        page = self._arrays[heads][slot]
        page[...] = chunk
        return page

    def removed(self, key) -> None:
        with self._lock:
            slot = self.slot_of.pop(key, None)
            if slot is not None:
                self._free[self.layout.page_key(key[1])].append(slot)

    def slots(self, keys) -> np.ndarray:
        """The slot of each of `keys` (one page key), -1 where the tier keeps a chunk outside the pages."""
        with self._lock:
            return np.fromiter(map(self.slot_of.get, keys, itertools.repeat(-1)), np.int64, len(keys))
