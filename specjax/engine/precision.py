"""Prefix KV loaded at a precision (docs/systems.md, "Low-bit KV").

A store may hold K and V a second time at 8, 4 or 2 bits per element (`stores.Layout.bits`: K's token rows codes
against their chunk's per-channel range, `kernels.quant.encode_key_chunks`, kept as the kind `K_RANGE`; V's rows
their codes and their groups' scales, `encode_rows`). `Precision` says which store kind a layer's take of K or V
reads, `--kv_bits` of any system, and decodes a low-bit take's rows on the device (`decoded_dtype`) before the
attention reads them; a take of low-bit K takes the ranges of the chunks its rows lie in too (`take_decoded`).
`WithRest` wraps an identification so that what it leaves out is loaded at low precision instead of dropped, chunk by
chunk (spec_mixed): every chunk a layer's selection touches is taken whole at the selection's precision, the other
chunks' positions with V at `rest_bits` and K at `rest_key_bits` (one take of every position's K where those are the
selection's bits, the probe keys rows of it; none where the identification holds every position's keys anyway: its
probe keys are every KV head's), and the layer attends to every position.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.connector import K_RANGE, PROBE, K, Layout, Locations, V, bits_of, in_chunk_range, low_bit
from specjax.engine import steps as S
from specjax.engine.identify import iota
from specjax.engine.policy_steps import Facts, Layer, Locate, Selected, Steps, Take, TakeChosen
from specjax.errors import SpecjaxError
from specjax.kernels import SharedIndices, quant
from specjax.shapes import bucket, padded


@dataclasses.dataclass(frozen=True)
class Precision:
    """How a request's takes of K, V and probe keys read the store: at `kv_bits` (None: the store's dtype), decoded
    on the device."""

    layout: Layout
    kv_bits: int | None
    dtype: object
    probe_is_k: bool = False

    def __post_init__(self):
        if self.kv_bits is not None and self.kv_bits not in self.layout.bits:
            raise SpecjaxError(f"loading K and V at {self.kv_bits} bits needs a store that holds them so; this one "
                               f"holds {_held(self.layout)}")

    def kind(self, kind: int) -> int:
        """The store kind read for a policy's `kind`: K, V and probe keys at `kv_bits` (probe keys that are every KV
        head's keys as K, so that they are the same rows as the layer's keys, and cached once); a low-bit kind a
        policy names itself (spec_mixed's rest) as it is."""
        if self.kv_bits is None or bits_of(kind) is not None:
            return kind
        return low_bit(K if kind == PROBE and self.probe_is_k else kind, self.kv_bits)

    def decode(self, kind: int, rows, ranges=None):
        """A take's rows `[heads, n, width]` of store kind `kind` as `[heads, n, head_dim]`: decoded on the device
        where `kind` is low-bit (`decoded_dtype`), as they are otherwise. Low-bit K needs `ranges`: (the range rows
        of the chunks its rows lie in, whole, `[heads, C * chunk_tokens, w]`; each row's chunk among them, int [n])."""
        bits = bits_of(kind)
        if bits is None:
            return rows
        lay, dtype = self.layout, decoded_dtype(self.dtype)
        if in_chunk_range(kind):
            if ranges is None:
                raise ValueError("low-bit K rows decode against their chunks' ranges: none were given")
            return _decode_keys(rows, *ranges, bits=bits, head_dim=lay.head_dim, chunk_tokens=lay.chunk_tokens,
                                dtype=dtype)
        return _decode(rows, bits=bits, group=lay.group_channels, head_dim=lay.head_dim, dtype=dtype)


def take_decoded(prefetcher, match, layer: int, kind: int, positions, loc: Locations, pad_to: int, decode,
                 **take_args):
    """`prefetcher.take` of `positions` (at `loc`) of store kind `kind`, decoded by `decode(kind, rows, ranges)`
    (`Precision.decode`, perhaps wrapped): low-bit K with the range rows of every chunk it lies in, taken whole.
    Returns (the take, the decoded array, the range take or None)."""
    taken = prefetcher.take(match, layer, kind, positions, pad_to=pad_to, loc=loc, **take_args)
    if not in_chunk_range(kind):
        return taken, decode(kind, taken.array, None), None
    chunks, chunk_of = loc.chunk_index
    ct = prefetcher.store.layout.chunk_tokens
    rows = Locations.whole(chunks, ct)
    ranges = prefetcher.take(match, layer, K_RANGE, np.arange(len(rows.chunks)), pad_to=range_rows(len(chunks), ct),
                             loc=rows)
    chunk_of_row = np.zeros(pad_to, np.int32)
    chunk_of_row[:len(chunk_of)] = chunk_of
    return taken, decode(kind, taken.array, (ranges.array, chunk_of_row)), ranges


def range_rows(n_chunks: int, chunk_tokens: int) -> int:
    """The rows a take of `n_chunks` chunks' key ranges is padded to (a bucket of chunks, so its decoding compiles
    once per bucket)."""
    return bucket(n_chunks) * chunk_tokens


def decoded_dtype(model_dtype) -> jnp.dtype:
    """What low-bit rows decode to: the model's dtype, but float32 on a CPU, whose attention computes in float32
    anyway and where XLA converts to bfloat16 in software (a decode into bfloat16 took three times as long)."""
    return jnp.dtype(jnp.float32) if jax.default_backend() == "cpu" else jnp.dtype(model_dtype)


def _held(layout: Layout) -> str:
    return f"K and V at {layout.dtype} and {', '.join(map(str, layout.bits))} bits" if layout.bits else \
        f"K and V at {layout.dtype} only"


def check_store(system, layout: Layout) -> None:
    """Refuse a store that lacks a precision `system` loads (its `store_bits`), naming what it holds."""
    missing = [b for b in system.store_bits if b not in layout.bits]
    if missing:
        raise SpecjaxError(f"system {system.name!r} loads K and V at {', '.join(map(str, missing))} bits, but its "
                           f"store holds {_held(layout)}; open a store made with kv_bits={list(system.store_bits)}")


@functools.partial(jax.jit, static_argnames=("bits", "group", "head_dim", "dtype"))
def _decode(rows, *, bits, group, head_dim, dtype):
    return quant.decode_rows(rows, bits=bits, group=group, head_dim=head_dim, dtype=dtype)


@functools.partial(jax.jit, static_argnames=("bits", "head_dim", "chunk_tokens", "dtype"))
def _decode_keys(codes, ranges, chunk_of_row, *, bits, head_dim, chunk_tokens, dtype):
    lo, hi = quant.key_ranges(ranges, head_dim=head_dim, chunk_tokens=chunk_tokens)
    return quant.decode_key_codes(codes, lo, hi, chunk_of_row, bits=bits, head_dim=head_dim, dtype=dtype)


@functools.partial(jax.jit, static_argnames=("size",))
def _laid(rows, src, dst, *, size):
    """[heads, size, d] zeros with rows[:, src[i]] at row dst[i] (dst >= size is padding, dropped)."""
    out = jnp.zeros((rows.shape[0], size, rows.shape[2]), rows.dtype)
    return out.at[:, dst].set(jnp.take(rows, src, axis=1), mode="drop")


@jax.jit
def _overlay(base, rows, src, dst):
    """`base` [heads, M, d] with rows[:, src[i]] at row dst[i] (dst >= M is padding, dropped)."""
    taken = jnp.take(rows, src, axis=1, mode="fill", fill_value=0).astype(base.dtype)
    return base.at[:, dst].set(taken, mode="drop")


class _Held:
    """A layer's rows of one kind taken so far, laid at their positions in [heads, m_pad, d] (`array`, None until
    the first take), and which positions they are (`has`)."""

    def __init__(self, m: int, m_pad: int):
        self.m_pad, self.array, self.has = m_pad, None, np.zeros(m, bool)

    def missing(self, positions) -> np.ndarray:
        return positions[~self.has[positions]]

    def lay(self, rows, positions) -> None:
        """`rows` [heads, >= len(positions), d] of a take of `positions` (in order), laid at them."""
        src = np.arange(rows.shape[1], dtype=np.int32)
        dst = padded(positions, rows.shape[1], self.m_pad)
        self.array = _laid(rows, src, dst, size=self.m_pad) if self.array is None else \
            _overlay(self.array, rows, src, dst)
        self.has[positions] = True

    def rows(self, positions, pad_to: int, heads: tuple | None = None):
        """The rows of `positions` [heads, pad_to, d] (of `heads` only, if given), zeros after them: as a take of
        them gives them."""
        rows = S.gather_tokens(self.array, jnp.asarray(padded(positions, pad_to, self.m_pad)))
        return rows if heads is None else rows[np.asarray(heads)]


class WithRest:
    """An identification whose left-out prefix tokens load at low precision (V at `bits`, K at `key_bits`, None:
    `bits`) instead of being dropped, chunk by chunk: the store reads whole chunks, so every chunk a layer's
    selection touches is taken whole at the selection's precision (the rows of its chunks the selection did not
    choose come free with it), and only the positions in the chunks it does not touch at the rest's. The wrapped
    policy selects as it does alone; its takes of K and V are answered from those whole-chunk takes, its takes on
    the device (`TakeChosen`) declined. Where the rest's keys are at the selection's precision (spec_mixed-kv8's, at
    8 bits) every position's K is one take, planned at the request's start, and the probe keys and the selection's
    keys are rows of it; where the policy holds every position's keys anyway (`keys_at_hand`), those are the keys and
    no other K is read. The layer attends to every position."""

    def __init__(self, inner, bits: int, key_bits: int | None = None):
        self.inner, self.bits, self.key_bits = inner, bits, bits if key_bits is None else key_bits

    def keys_at_hand(self, f: Facts) -> bool:
        """Does the wrapped policy hold every position's keys whatever it selects (its `takes_every_key`: probe keys
        that are every KV head's, or every head scored)? Then those are the rest's keys, read once, at the
        selection's precision, and no low-bit K is read."""
        takes = getattr(self.inner, "takes_every_key", None)
        return bool(takes is not None and takes(f))

    def rest_key_bits(self, f: Facts) -> int | None:
        """The bits the rest's keys load at: None where they are the policy's own (`keys_at_hand`), at the
        selection's precision."""
        return None if self.keys_at_hand(f) else self.key_bits

    def keys_once(self, f: Facts) -> bool:
        """Are the rest's keys read at the selection's precision (not at hand)? Then every position's K is one
        take, whatever the layer selects."""
        key_bits = self.rest_key_bits(f)
        return key_bits is not None and key_bits == f.system.kv_bits

    def certain_reads(self, f: Facts) -> tuple:
        """The wrapped policy's, and every position's K where it is one take (`keys_once`: then the probe keys are
        its rows, not read apart); the rest's other rows lie in the chunks the selection does not touch, known once it
        has chosen."""
        if not self.keys_once(f):
            return tuple(self.inner.certain_reads(f))
        return tuple(kind for kind in self.inner.certain_reads(f) if kind != PROBE) + (K,)

    def selection_reads(self, f: Facts) -> tuple:
        """The wrapped policy's, less K where every position's K is one certain read: a guess reads none again."""
        kinds = tuple(self.inner.selection_reads(f))
        return tuple(kind for kind in kinds if kind != K) if self.keys_once(f) else kinds

    def select(self, f: Facts, layer: Layer, state) -> Steps:
        m, m_pad = layer.m, layer.m_pad
        every = np.arange(m)
        if not np.array_equal(layer.positions, every):  # its rows are positions: a layer over the prefix from 0
            raise SpecjaxError(f"{f.system.name}'s rest is taken over a whole prefix, positions 0..m-1")
        chunk_of = (yield Locate(layer.positions)).chunks
        once = self.keys_once(f)
        held = {K: _Held(m, m_pad), V: _Held(m, m_pad)}  # rows taken at the selection's precision
        steps, result = self.inner.select(f, layer, state), None
        try:
            while True:
                step = steps.send(result)
                if isinstance(step, TakeChosen):
                    result = None  # taken as whole chunks instead, below
                elif isinstance(step, Take) and (step.kind in held or once and step.kind == PROBE):
                    wanted = every if step.positions is None else np.asarray(step.positions, np.int64)
                    kind = K if step.kind == PROBE else step.kind  # probe keys: rows of the probe heads' K
                    rows = held[kind]
                    need = rows.missing(every if once and kind == K else every[np.isin(chunk_of, chunk_of[wanted])])
                    if len(need):
                        importance = None
                        if step.importance is not None:  # the chosen rows' importance; none for the others
                            importance = np.zeros(m, np.float32)
                            importance[wanted] = step.importance
                            importance = importance[need]
                        rows.lay((yield Take(kind, need, min(bucket(len(need)), m_pad), step.phase, importance)),
                                 need)
                    result = rows.rows(wanted, m_pad if step.pad_to is None else step.pad_to,
                                       f.probe_kv if step.kind == PROBE else None)
                else:
                    result = yield step
        except StopIteration as done:
            chosen = done.value
        finally:
            steps.close()
        if self.keys_at_hand(f):
            if isinstance(chosen.selection, SharedIndices) and chosen.all_keys is None:
                raise SpecjaxError(f"{type(self.inner).__name__} says it holds every position's keys, but its shared "
                                   "set came without them (Selected.all_keys)")
            keys = chosen.keys if chosen.all_keys is None else chosen.all_keys
        else:
            keys = yield from self._rest(held[K], K if once else low_bit(K, self.key_bits), m_pad)
        values = yield from self._rest(held[V], low_bit(V, self.bits), m_pad)
        return Selected(chosen.state, keys, values, SharedIndices(iota(m_pad), m), chosen.importance, chosen.chosen)

    @staticmethod
    def _rest(held: _Held, kind: int, m_pad: int) -> Steps:
        """Every position's rows: those taken at the selection's precision, the others' taken as store kind `kind`."""
        rest = held.missing(np.arange(len(held.has)))
        if len(rest):
            held.lay((yield Take(kind, rest, min(bucket(len(rest)), m_pad))), rest)
        return held.array
