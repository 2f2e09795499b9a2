"""The on-disk KV (TensorStore kvstore): one extent per stored segment, layer and kind; reads of chunk runs as byte
ranges of those extents through one read scheduler; O_DIRECT. A local directory's extents are read with `preadv`
straight into reused landing buffers (`stores.landing`), any other kvstore's through TensorStore.

Layout (store format 3): a segment of n chunks writes, for each layer and kind (K, V, probe keys), one file
`kv/<first chunk, 12 digits>+<n>/<layer>/<k|v|probe>` holding its chunks one after another, each chunk its heads one
after another (`[n, heads, chunk_tokens, head_dim]`, little-endian). A segment's layer is then one contiguous extent:
loading all of it is one multi-MiB read, a run of adjacent chunks one byte range, and one device of a
tensor-parallel mesh reads its own heads' byte range of each chunk. The chunk stays the unit of selection, checksum
and caching; the extent is the unit of the disk read. (Format 2 kept one file per 64-token chunk: an open and a
small read per 64 KiB, which held a GPU-sized request to a fraction of the disk's rate.)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools

import numpy as np
import tensorstore as ts

from specjax.kernels import quant
from specjax.stores.landing import BUFFERS, LocalFiles
from specjax.stores.scheduler import Read, ReadScheduler, when_all

K, V, PROBE = 0, 1, 2
LOW_BITS = (8, 4, 2)  # the low precisions a store may hold K, V and probe keys at, besides the model's dtype
# (what, bits) of each low-bit kind, kind 3 onwards: K and V at each precision, then the probe keys at each (after
# them, so that K's and V's kinds have the numbers they had in stores holding no low-bit probe keys)
_LOW_KINDS = (tuple((base, bits) for bits in LOW_BITS for base in (K, V))
              + tuple((PROBE, bits) for bits in LOW_BITS))
# after them, the kind holding each chunk's per-channel key range, which low-bit K's codes are against (any bits)
K_RANGE = 3 + len(_LOW_KINDS)
KIND_NAMES = (("k", "v", "probe") + tuple(f"{('k', 'v', 'probe')[base]}{bits}" for base, bits in _LOW_KINDS)
              + ("krange",))
# what a store holding low-bit KV keeps at each precision (a fingerprint's `kv_format`): 3, K as codes against its
# chunk's per-channel range (`K_RANGE`), V and probe keys as rows that decode alone; 2, K as such rows too; 1 (no
# `kv_format`), K and V only
LOW_BIT_FORMAT = 3


def low_bit(kind: int, bits: int) -> int:
    """The kind holding `kind`'s (K, V or probe keys) rows at `bits` bits: K's codes against its chunk's range
    (`kernels.quant.encode_key_chunks`), V's and probe keys' rows with their own scales (`encode_rows`)."""
    if (kind, bits) not in _LOW_KINDS:
        raise ValueError(f"K, V and probe keys are stored at low precision at {LOW_BITS} bits; got "
                         f"{KIND_NAMES[kind] if 0 <= kind < len(KIND_NAMES) else kind} at {bits}")
    return 3 + _LOW_KINDS.index((kind, bits))


def bits_of(kind: int) -> int | None:
    """The bits of a low-bit kind (`low_bit`); None for K, V, probe keys (held in the store's dtype) and K_RANGE."""
    return None if kind < 3 or kind == K_RANGE else _LOW_KINDS[kind - 3][1]


def base_of(kind: int) -> int:
    """K, V or PROBE: what a kind holds, at whatever precision (K_RANGE: K's)."""
    return kind if kind < 3 else K if kind == K_RANGE else _LOW_KINDS[kind - 3][0]


def in_chunk_range(kind: int) -> bool:
    """Whether `kind`'s rows decode only with their chunk's range (`K_RANGE`): low-bit K."""
    return bits_of(kind) is not None and base_of(kind) == K


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a store's chunks hold: `num_layers` layers of `kv_heads` K and V heads (and `probe_heads` probe keys) of
    `head_dim` channels, `chunk_tokens` tokens a chunk, in `dtype`; and the same K, V (and probe keys) again at each of
    `bits` (`low_bit` kinds: K's codes against each chunk's per-channel range, `K_RANGE`; V's and probe keys' per
    token, `group_channels` channels a scale and zero point, `kernels.quant.encode_rows`)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    probe_heads: int
    chunk_tokens: int = 64
    dtype: str = "float32"
    bits: tuple[int, ...] = ()
    group_channels: int = 32

    def __post_init__(self):
        object.__setattr__(self, "bits", tuple(sorted({int(b) for b in self.bits}, reverse=True)))
        if self.chunk_tokens <= 0 or self.num_layers <= 0 or self.kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"layout sizes must be positive, got {self}")
        if self.probe_heads < 0:
            raise ValueError(f"probe_heads must be >= 0, got {self.probe_heads}")
        if any(b not in LOW_BITS for b in self.bits):
            raise ValueError(f"a store holds K and V at {LOW_BITS} bits, got bits={self.bits}")
        if self.bits and (self.group_channels <= 0 or self.head_dim % self.group_channels
                          or self.group_channels * min(self.bits) % 8):
            raise ValueError(f"group_channels={self.group_channels} must divide head_dim={self.head_dim} and fill "
                             f"whole bytes at {min(self.bits)} bits")

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype) if self.dtype != "bfloat16" else np.dtype(_bfloat16())

    def heads(self, kind: int) -> int:
        return self.probe_heads if base_of(kind) == PROBE else self.kv_heads

    def dtype_of(self, kind: int) -> np.dtype:
        """The element type of a kind's rows: the store's dtype, or bytes for a low-bit kind (which no float type
        carries intact: XLA:CPU moves bfloat16 through float32, flushing subnormal bit patterns)."""
        return self.np_dtype if kind < 3 else np.dtype(np.uint8)

    def width(self, kind: int) -> int:
        """A token row's elements (`dtype_of`): head_dim; or a low-bit row's bytes: K's codes, or V's and probe
        keys' codes, then each channel group's float16 scale, then each group's float16 zero point; or K_RANGE's
        share of its chunk's range block."""
        if kind == K_RANGE:
            return quant.key_range_width(self.head_dim, self.chunk_tokens)
        bits = bits_of(kind)
        if bits is None:
            return self.head_dim
        if base_of(kind) == K:
            return self.head_dim * bits // 8
        return quant.row_nbytes(self.head_dim, bits, self.group_channels)

    def page_key(self, kind: int) -> tuple[int, int, int]:
        """(heads, width, bytes per element): kinds with equal keys share the cache tiers' page arrays (stores.pool),
        whose element type is `page_dtype(key)`."""
        return self.heads(kind), self.width(kind), self.dtype_of(kind).itemsize

    def page_dtype(self, key: tuple[int, int, int]) -> np.dtype:
        """The element type of the rows a page key's kinds hold (the store's dtype, or bytes)."""
        return self.np_dtype if key[2] == self.np_dtype.itemsize else np.dtype(np.uint8)

    @property
    def max_heads(self) -> int:
        return max(self.kv_heads, self.probe_heads)

    def chunk_nbytes(self, kind: int) -> int:
        return self.heads(kind) * self.chunk_tokens * self.token_row_nbytes(kind)

    def token_nbytes(self, kind: int) -> int:
        return self.heads(kind) * self.token_row_nbytes(kind)

    def token_row_nbytes(self, kind: int) -> int:
        """Bytes of one head's row of one token."""
        return self.width(kind) * self.dtype_of(kind).itemsize

    def chunk_shape(self, kind: int) -> tuple[int, int, int]:
        """[heads, chunk_tokens, width] of one chunk of `kind`."""
        return self.heads(kind), self.chunk_tokens, self.width(kind)

    def kinds(self) -> tuple[int, ...]:
        base = (K, V, PROBE) if self.probe_heads else (K, V)
        low = tuple(low_bit(kind, bits) for bits in self.bits for kind in base)
        return base + low + ((K_RANGE,) if self.bits else ())

    @property
    def kind_slots(self) -> int:
        """The kind axis of a segment's checksums: indexed by kind."""
        return max(self.kinds()) + 1


def _bfloat16():
    import ml_dtypes  # shipped with jax

    return ml_dtypes.bfloat16


def _under(kvstore: dict, path: str) -> dict:
    """The kvstore spec of folder `path` inside `kvstore`."""
    store = dict(kvstore)
    store["path"] = store.get("path", "").rstrip("/") + "/" + path + "/" if store.get("path") else path + "/"
    return store


def segment_prefix(first_chunk: int) -> str:
    """The start of the keys of the segment whose first chunk is `first_chunk` (sorted by it)."""
    return f"{first_chunk:012d}+"


def extent_key(first_chunk: int, n_chunks: int, layer: int, kind: int) -> str:
    """The file (relative to `kv/`) holding a segment's chunks of one layer and kind."""
    return f"{segment_prefix(first_chunk)}{n_chunks}/{layer}/{KIND_NAMES[kind]}"


def parse_extent_key(key: str) -> tuple[int, int] | None:
    """(first chunk, n chunks) of a segment's file key (relative to `kv/`); None for any other key."""
    head = key.split("/", 1)[0]
    first, sep, n = head.partition("+")
    if not sep or not first.isdigit() or not n.isdigit():
        return None
    return int(first), int(n)


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
    """The extents of a store's segments (module docstring); reads of chunk runs go through its disk's
    `ReadScheduler`."""

    def __init__(self, kvstore: dict, layout: Layout, context: ts.Context, *, disk_bandwidth: float | None = None,
                 max_inflight_bytes: int | None = None, direct_io: bool = False):
        self.layout = layout
        self.context = context
        extents = _under(kvstore, "kv")
        self._kvs = ts.KvStore.open(extents, context=context).result()
        # a local directory's extents are read with preadv straight into landing buffers (stores.landing)
        self._files = LocalFiles(extents["path"], direct_io) if extents.get("driver") == "file" else None
        self.scheduler = ReadScheduler(max_inflight_bytes=max_inflight_bytes, bytes_per_s=disk_bandwidth)
        self.direct_io = direct_io

    def shares_requests(self, speculative: bool) -> bool:
        """Do runs read together share one disk request (`ChunkReader.read_runs`)? From the page cache, yes: a read
        there is a copy, and issuing and landing a request is the cost. Not with O_DIRECT, where each run waits on
        the device and the disk works through them at its queue depth; nor speculative runs on an emulated disk,
        where they wait in its queue and a run superseded there is withdrawn unread (a shared request is withdrawn
        only once none of its runs is wanted)."""
        return not self.direct_io and (not speculative or self.scheduler.link is None)

    def extent_of(self, layer: int, kind: int, seg_first: int, seg_chunks: int, chunk: int) -> tuple[str, int]:
        """(file key under `kv/`, byte offset) of a chunk of the segment starting at chunk `seg_first`."""
        return extent_key(seg_first, seg_chunks, layer, kind), (chunk - seg_first) * self.layout.chunk_nbytes(kind)

    def read_runs(self, layer: int, kind: int, runs: list[tuple], *, speculative: bool = False,
                  background: bool = False, head_parts: int = 1, own_parts: range | None = None) -> Read:
        """Queue one disk request (at the scheduler's priority `speculative` / `background`) for `runs`, each
        `(segment's first chunk, its chunk count, first chunk, n_chunks, into)`: n_chunks adjacent chunks of one
        segment, one byte range of its extent. Its future resolves, once the scheduler has issued it and (on an
        emulated disk) its bytes have crossed the link, with one result per run: `[n_chunks, heads, chunk_tokens,
        head_dim]` (a view of the bytes read), or the exception that run's read raised (its extent missing or too
        short); one run's failure is not the others'. A local store's runs are read one after another by one disk
        thread: several runs cost one task, one landing and one callback.

        `head_parts` > 1: each chunk is read as that many byte ranges of equal head counts, one per device of a
        tensor-parallel mesh (a chunk holds its heads one after another), as each device's reader would read its own
        heads; the parts are joined in head order. `own_parts` (default: all): the parts read, those of this
        process's devices on a mesh over several processes; a chunk's other heads are left as `into` (or a new
        buffer) held them.

        `into` (or None): `[n_chunks, heads, chunk_tokens, head_dim]` (a slice of a preallocated, aligned host buffer)
        that the run's bytes land in; its result is then `into`."""
        lay = self.layout
        chunk_bytes = lay.chunk_nbytes(kind)
        own = range(head_parts) if own_parts is None or head_parts == 1 else own_parts
        reads = []  # (key, byte ranges, where each lands in the run's bytes, shape, into) per run
        for seg_first, seg_chunks, first_chunk, n_chunks, into in runs:
            key, offset = self.extent_of(layer, kind, seg_first, seg_chunks, first_chunk)
            if head_parts == 1:
                ranges, at = [slice(offset, offset + n_chunks * chunk_bytes)], [0]
            else:
                part = chunk_bytes // head_parts
                at = [j * chunk_bytes + p * part for j in range(n_chunks) for p in own]
                ranges = [slice(offset + a, offset + a + part) for a in at]
            reads.append((key, ranges, at, (n_chunks, *lay.chunk_shape(kind)), into, lay.dtype_of(kind)))

        def issue() -> concurrent.futures.Future:
            if self._files is not None:
                return self._files.read_many([(key, ranges, at, BUFFERS.empty(shape, dtype) if into is None else into)
                                              for key, ranges, at, shape, into, dtype in reads])
            futures = [[self._kvs.read(key.encode(), byte_range=r) for r in ranges] for key, ranges, *_ in reads]
            return when_all([f for fs in futures for f in fs], functools.partial(self._decode_all, reads))

        nbytes = sum(run[3] for run in runs) * chunk_bytes // head_parts * len(own)
        return self.scheduler.submit(Read(issue, nbytes, speculative, background, order=layer))

    def _decode_all(self, reads: list[tuple], results: list) -> list:
        """Per run of `read_runs`, its array decoded from its ranges' kvstore reads, or the exception that raised."""
        out, at = [], 0
        for key, ranges, lands, shape, into, dtype in reads:
            try:
                out.append(self._decode(key, shape, dtype, results[at:at + len(ranges)], ranges, lands, into))
            except Exception as e:  # noqa: BLE001 -- this run's failure, delivered with the others' data
                out.append(e)
            at += len(ranges)
        return out

    def _decode(self, key: str, shape: tuple, dtype: np.dtype, results: list, ranges: list, lands: list,
                into: np.ndarray | None = None) -> np.ndarray:
        """`[n_chunks, heads, chunk_tokens, head_dim]` from the reads of the extent's byte `ranges`, each at its byte
        offset in `lands` (copied into `into` if given)."""
        for result, byte_range in zip(results, ranges):
            if result.state == "missing":
                raise ValueError(f"extent kv/{key} is missing")
            if len(result.value) != byte_range.stop - byte_range.start:
                raise ValueError(f"extent kv/{key} holds {len(result.value)} bytes at "
                                 f"{byte_range.start}..{byte_range.stop}, expected {byte_range.stop - byte_range.start}")
        if into is not None and len(results) == 1:
            into.reshape(-1).view(np.uint8)[:] = np.frombuffer(results[0].value, np.uint8)
            return into
        whole = sum(r.stop - r.start for r in ranges) == int(np.prod(shape)) * np.dtype(dtype).itemsize
        if into is None and whole:
            data = results[0].value if len(results) == 1 else b"".join(r.value for r in results)
            return np.frombuffer(data, dtype).reshape(shape)
        out = into if into is not None else BUFFERS.empty(shape, dtype)
        dest = out.reshape(-1).view(np.uint8)
        for result, at in zip(results, lands):
            dest[at:at + len(result.value)] = np.frombuffer(result.value, np.uint8)
        return out

    def write_range(self, layer: int, kind: int, first_chunk: int, data: np.ndarray):
        """Write a whole segment's `[heads, n_chunks * chunk_tokens, head_dim]` of one layer and kind as its extent;
        the future resolves when it is durable."""
        c = self.layout.chunk_tokens
        heads, tokens, d = data.shape
        n = tokens // c
        chunks = np.ascontiguousarray(np.asarray(data).reshape(heads, n, c, d).transpose(1, 0, 2, 3))
        return self._kvs.write(extent_key(first_chunk, n, layer, kind).encode(), chunks.tobytes())

    def delete_range(self, first_chunk: int, n_chunks: int) -> None:
        """Delete the extents of every segment whose first chunk lies in [first_chunk, first_chunk + n_chunks)."""
        self._kvs.delete_range(ts.KvStore.KeyRange(segment_prefix(first_chunk).encode(),
                                                   segment_prefix(first_chunk + n_chunks).encode())).result()

    def stored_chunk_ids(self) -> set[int]:
        """Chunk ids of every segment that has any extent on disk (used to find orphans of crashed inserts)."""
        ids = set()
        for key in self._kvs.list().result():
            parsed = parse_extent_key(key.decode())
            if parsed is not None:
                ids.update(range(parsed[0], parsed[0] + parsed[1]))
        return ids
