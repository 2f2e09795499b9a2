"""Prefix KV loaded at a precision (docs/systems.md, "Low-bit KV").

A store may hold K and V a second time at 8, 4 or 2 bits per element (`stores.Layout.bits`: K's token rows codes
against their chunk's per-channel range, `kernels.quant.encode_key_chunks`, kept as the kind `K_RANGE`; V's rows
their codes and their groups' scales, `encode_rows`). `Precision` says which store kind a layer's take of K or V
reads, `--kv_bits` of any system, and decodes a low-bit take's rows on the device (`decoded_dtype`) before the
attention reads them; a take of low-bit K takes the ranges of the chunks its rows lie in too (`take_decoded`).
`WithRest` wraps an identification so that the prefix tokens it does not select are loaded at low precision instead
of dropped (spec_mixed): every layer reads all of the prefix's V at `rest_bits` (a certain read, planned at the
request's start) and its K at `rest_key_bits`, unless the identification holds every position's keys anyway (its
probe keys are every KV head's: those are the rest's keys then, at the selection's precision); the selection's rows
as they were taken replace theirs, and the layer attends to every position.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.connector import K_RANGE, PROBE, K, Layout, Locations, V, bits_of, in_chunk_range, low_bit
from specjax.engine.identify import iota
from specjax.engine.policy_steps import Facts, Layer, Selected, Steps, Take
from specjax.errors import SpecjaxError
from specjax.idsets import distinct
from specjax.kernels import PerHeadIndices, SharedIndices, quant
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


@jax.jit
def _overlay(rest, rows, src, dst):
    """`rest` [heads, M, d] with rows[:, src[i]] at token dst[i] (dst >= M is padding, dropped)."""
    taken = jnp.take(rows, src, axis=1, mode="fill", fill_value=0).astype(rest.dtype)
    return rest.at[:, dst].set(taken, mode="drop")


class WithRest:
    """An identification whose unselected prefix tokens load at low precision (V at `bits`, K at `key_bits`, None:
    `bits`) instead of being dropped. The wrapped policy selects and reads as it does alone; this then takes every
    position's low-bit V, and K where the policy does not hold every position's keys already (`keys_at_hand`), and
    lays the rows the selection took over theirs: a shared set's rows are its chosen positions in order, a per-head
    layer's keys are every position's (all of them taken), its values the union's. The layer attends to every
    position."""

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

    def certain_reads(self, f: Facts) -> tuple:
        key_bits = self.rest_key_bits(f)
        rest = (low_bit(V, self.bits),) if key_bits is None else (low_bit(K, key_bits), low_bit(V, self.bits))
        return tuple(self.inner.certain_reads(f)) + rest

    def selection_reads(self, f: Facts) -> tuple:
        """The wrapped policy's, less K where the rest's keys are every position's K at the selection's bits: the
        certain reads bring them, and a guess reads none again."""
        kinds = tuple(self.inner.selection_reads(f))
        key_bits = self.rest_key_bits(f)
        if key_bits is not None and key_bits == f.system.kv_bits:
            kinds = tuple(kind for kind in kinds if kind != K)
        return kinds

    def select(self, f: Facts, layer: Layer, state) -> Steps:
        chosen = yield from self.inner.select(f, layer, state)
        key_bits = self.rest_key_bits(f)
        at_hand = key_bits is None
        rest_k = None if at_hand else (yield Take(low_bit(K, key_bits)))
        rest_v = yield Take(low_bit(V, self.bits))
        m, m_pad = layer.m, layer.m_pad
        if isinstance(chosen.selection, PerHeadIndices):
            union = distinct(np.asarray(chosen.chosen))
            slots = padded(union, bucket(len(union)), m_pad)
            keys, values = chosen.keys, _overlay(rest_v, chosen.values, slots, slots)
        else:
            count = int(chosen.selection.count)
            rows = padded(np.asarray(chosen.selection.idx)[:count], bucket(max(count, 1)), chosen.keys.shape[1])
            dst = padded(np.asarray(chosen.chosen)[0, :count], len(rows), m_pad)
            if at_hand and chosen.all_keys is None:
                raise SpecjaxError(f"{type(self.inner).__name__} says it holds every position's keys, but its shared "
                                   "set came without them (Selected.all_keys)")
            keys = chosen.all_keys if at_hand else _overlay(rest_k, chosen.keys, rows, dst)
            values = _overlay(rest_v, chosen.values, rows, dst)
        return Selected(chosen.state, keys, values, SharedIndices(iota(m_pad), m), chosen.importance, chosen.chosen)
