"""Low-bit KV: integers of 8, 4 or 2 bits with a scale and a zero point per group, packed into bytes.

The grouping is KIVI's (Liu et al., 2024): keys per channel over a group of tokens (a key's outlier channels keep a
scale of their own), values per token over a group of channels (a value row is what attention weighs). Each group is
quantised asymmetrically: code = round((x - min) / scale), scale = (max - min) / (2**bits - 1), so the group's min and
max are exact and an element is off by at most scale / 2. Codes are packed along the channel axis, 8 / bits to a
byte, the first channel in the lowest bits.

    q = quantize_keys(k, bits=4, group_tokens=64)     # k [H, T, d]: codes uint8 [H, T, d * 4 / 8]
    k_hat = dequantize(q)                              # float32 [H, T, d]

Everything here is jnp and jittable (`bits` and the group sizes are static).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

BITS = (8, 4, 2)


class Quantized(NamedTuple):
    """codes uint8 [H, T, d * bits / 8]; scale and zero float32, [H, T / group_tokens, d] for keys (per channel of a
    token group) or [H, T, d / group_channels] for values (per channel group of a token)."""

    codes: jax.Array
    scale: jax.Array
    zero: jax.Array
    bits: int
    per_channel: bool  # keys' grouping (True) or values' (False)

    @property
    def group(self) -> int:
        """Tokens a key scale covers, or channels a value scale covers."""
        tokens, channels = self.codes.shape[1], self.codes.shape[2] * 8 // self.bits
        return tokens // self.scale.shape[1] if self.per_channel else channels // self.scale.shape[2]

    def nbytes(self, scale_bytes: int = 2) -> int:
        """Bytes as stored: the codes, and each scale and zero point at `scale_bytes` (2: bf16)."""
        return self.codes.size + 2 * self.scale.size * scale_bytes


def _check(x, bits: int, axis: int, group: int, name: str) -> None:
    if bits not in BITS:
        raise ValueError(f"bits={bits}: choose one of {BITS}")
    if x.ndim != 3:
        raise ValueError(f"{name} must be [H, T, d], got shape {x.shape}")
    if group < 1 or x.shape[axis] % group:
        raise ValueError(f"{name}'s axis {axis} ({x.shape[axis]}) is not a multiple of the group ({group})")
    if x.shape[2] * bits % 8:
        raise ValueError(f"{x.shape[2]} channels of {bits} bits do not fill whole bytes")


def _codes(x, lo, hi, bits: int):
    levels = (1 << bits) - 1
    scale = (hi - lo) / levels
    safe = jnp.where(scale > 0, scale, 1.0)  # a constant group: every code 0, the value its zero point
    codes = jnp.clip(jnp.round((x - lo) / safe), 0, levels).astype(jnp.uint8)
    return codes, scale


def pack(codes, bits: int):
    """uint8 codes < 2**bits [..., d] -> bytes [..., d * bits / 8], channel i of a byte in bits [i*bits, (i+1)*bits)."""
    per_byte = 8 // bits
    if per_byte == 1:
        return codes
    grouped = codes.reshape(codes.shape[:-1] + (codes.shape[-1] // per_byte, per_byte)).astype(jnp.uint32)
    shifts = jnp.arange(per_byte, dtype=jnp.uint32) * bits
    return jnp.sum(grouped << shifts, axis=-1).astype(jnp.uint8)


def unpack(packed, bits: int):
    """The inverse of `pack`: bytes [..., n] -> codes uint8 [..., n * 8 / bits]."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * bits
    codes = (packed[..., None] >> shifts) & jnp.uint8((1 << bits) - 1)
    return codes.reshape(packed.shape[:-1] + (packed.shape[-1] * per_byte,))


def quantize_keys(k, *, bits: int, group_tokens: int) -> Quantized:
    """Keys [H, T, d] per channel over each run of `group_tokens` tokens (T a multiple of it)."""
    _check(k, bits, 1, group_tokens, "keys")
    return Quantized(*_quantize_keys(k, bits=bits, group_tokens=group_tokens), bits, True)


def quantize_values(v, *, bits: int, group_channels: int) -> Quantized:
    """Values [H, T, d] per token over each run of `group_channels` channels (d a multiple of it)."""
    _check(v, bits, 2, group_channels, "values")
    return Quantized(*_quantize_values(v, bits=bits, group_channels=group_channels), bits, False)


def dequantize(q: Quantized):
    """float32 [H, T, d]."""
    return _dequantize(q.codes, q.scale, q.zero, bits=q.bits, per_channel=q.per_channel)


@functools.partial(jax.jit, static_argnames=("bits", "group_tokens"))
def _quantize_keys(k, *, bits, group_tokens):
    heads, tokens, channels = k.shape
    x = k.astype(jnp.float32).reshape(heads, tokens // group_tokens, group_tokens, channels)
    lo, hi = x.min(axis=2, keepdims=True), x.max(axis=2, keepdims=True)
    codes, scale = _codes(x, lo, hi, bits)
    return pack(codes.reshape(heads, tokens, channels), bits), scale[:, :, 0], lo[:, :, 0]


@functools.partial(jax.jit, static_argnames=("bits", "group_channels"))
def _quantize_values(v, *, bits, group_channels):
    heads, tokens, channels = v.shape
    x = v.astype(jnp.float32).reshape(heads, tokens, channels // group_channels, group_channels)
    lo, hi = x.min(axis=3, keepdims=True), x.max(axis=3, keepdims=True)
    codes, scale = _codes(x, lo, hi, bits)
    return pack(codes.reshape(heads, tokens, channels), bits), scale[..., 0], lo[..., 0]


@functools.partial(jax.jit, static_argnames=("bits", "per_channel"))
def _dequantize(packed, scale, zero, *, bits, per_channel):
    codes = unpack(packed, bits).astype(jnp.float32)
    axis = 1 if per_channel else 2
    group = codes.shape[axis] // scale.shape[axis]
    return codes * jnp.repeat(scale, group, axis=axis) + jnp.repeat(zero, group, axis=axis)


# -- rows: a token's codes with its own scales, as a store holds K and V at low precision ---------------------------
#
# A row is one head's token: its d codes packed (d * bits / 8 bytes), then, per group of `group` channels, the
# group's float16 scale, then each group's float16 zero point, then zero bytes up to `row_bytes`. Keys and values are
# both grouped per token here (a store's unit of selection is the token: any set of rows decodes without the others);
# `benchmarks/kv_precision.py --grouping rows` measures what that costs keys against KIVI's per-channel grouping.

def row_nbytes(head_dim: int, bits: int, group: int) -> int:
    """Bytes of one encoded row, before padding."""
    return head_dim * bits // 8 + 4 * (head_dim // group)


def encode_rows(x, *, bits: int, group: int, row_bytes: int | None = None):
    """Rows of `x` [..., d] (numpy, any float dtype) -> uint8 [..., row_bytes] (numpy; host side, no compilation):
    asymmetric codes over each run of `group` channels, with the group's float16 scale and zero point, which the
    codes are computed against (so an element is off by at most half its group's float16 scale)."""
    import numpy as np

    x = np.asarray(x, np.float32)
    d = x.shape[-1]
    if bits not in BITS or group < 1 or d % group or group * bits % 8:
        raise ValueError(f"cannot encode {d} channels at {bits} bits in groups of {group}")
    need = row_nbytes(d, bits, group)
    row_bytes = need if row_bytes is None else row_bytes
    if row_bytes < need:
        raise ValueError(f"a row of {d} channels at {bits} bits needs {need} bytes, got {row_bytes}")
    levels = (1 << bits) - 1
    g = x.reshape(x.shape[:-1] + (d // group, group))
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    with np.errstate(over="ignore"):
        scale = ((hi - lo) / levels).astype(np.float16)
        zero = lo.astype(np.float16)
    if not (np.isfinite(scale).all() and np.isfinite(zero).all()):
        raise ValueError("KV values beyond float16's range (or not finite) cannot be stored at low precision")
    s, z = scale.astype(np.float32), zero.astype(np.float32)
    codes = np.clip(np.rint((g - z[..., None]) / np.where(s > 0, s, 1)[..., None]), 0, levels).astype(np.uint8)
    codes = codes.reshape(x.shape[:-1] + (d // (8 // bits), 8 // bits)).astype(np.uint32)
    packed = (codes << (np.arange(8 // bits, dtype=np.uint32) * bits)).sum(axis=-1).astype(np.uint8)
    out = np.zeros(x.shape[:-1] + (row_bytes,), np.uint8)
    cb, ng = d * bits // 8, d // group
    out[..., :cb] = packed
    out[..., cb:cb + 2 * ng] = scale.view(np.uint8)
    out[..., cb + 2 * ng:cb + 4 * ng] = zero.view(np.uint8)
    return out


def as_bytes(rows):
    """Rows [..., w] of any element type -> their bytes, uint8 [..., w * itemsize] (a store's low-bit kinds arrive in
    the store's element type). Jittable."""
    if rows.dtype == jnp.uint8:
        return rows
    rows = jax.lax.bitcast_convert_type(rows, jnp.uint8)
    return rows.reshape(rows.shape[:-2] + (rows.shape[-2] * rows.shape[-1],))


def row_parts(rows, *, bits: int, group: int, head_dim: int):
    """Encoded rows [..., w] of any element type whose bytes they are -> (packed codes uint8 [..., head_dim * bits /
    8], float32 [..., 2 * groups]: each group's scale, then each group's zero point). Jittable."""
    rows = as_bytes(rows)
    cb, ng = head_dim * bits // 8, head_dim // group
    halves = rows[..., cb:cb + 4 * ng].reshape(rows.shape[:-1] + (2 * ng, 2))
    return rows[..., :cb], jax.lax.bitcast_convert_type(halves, jnp.float16).astype(jnp.float32)


def decode_rows(rows, *, bits: int, group: int, head_dim: int, dtype=jnp.float32):
    """The inverse of `encode_rows` on the device: rows [..., w] of any element type whose bytes are encoded rows
    (a store's low-bit kind as a take gives it) -> `dtype` [..., head_dim]. Jittable."""
    packed, scale_zero = row_parts(rows, bits=bits, group=group, head_dim=head_dim)
    codes = unpack(packed, bits).astype(jnp.float32)
    ng = head_dim // group
    scale, zero = scale_zero[..., :ng], scale_zero[..., ng:]
    x = codes.reshape(codes.shape[:-1] + (ng, group)) * scale[..., None] + zero[..., None]
    return x.reshape(codes.shape).astype(dtype)


# -- key chunks: a chunk's keys per channel, as a store holds K at low precision --------------------------------------
#
# KIVI groups keys per channel over a run of tokens: a key's outlier channels keep a range of their own. A store's run
# is its chunk. Each chunk's key rows are codes only (d * bits / 8 bytes), against the chunk's per-channel float16
# minimum and maximum (its range, shared by every precision), which the store keeps as a kind of its own: a chunk's
# range block (d minima, then d maxima, float16; zero bytes after) is spread over the chunk's token rows,
# `key_range_width` bytes to a row, so that the chunk holds it as it holds any kind. A take of selected key rows then
# takes the range rows of every chunk they lie in, whole (`key_ranges`).

def key_range_width(head_dim: int, chunk_tokens: int) -> int:
    """Bytes of a chunk's range block on each of its token rows: 4 * head_dim bytes over chunk_tokens rows."""
    return -(-4 * head_dim // chunk_tokens)


def encode_key_chunks(k, *, bits: int, chunk_tokens: int, keys=None):
    """Keys [H, T, d] (numpy, T a multiple of `chunk_tokens`) -> (codes uint8 [H, T, d * bits / 8], ranges uint8 [H,
    T, key_range_width]): per chunk and channel, the float16 minimum and maximum (rounded outwards, so every key lies
    inside them) and each key's code against them (off by at most half the channel's step). `keys` (bool [T], default
    every row) says which rows are keys: the others, a chunk's padding, are left out of its range (a padding row of
    zeros would stretch a channel that keeps one sign to reach 0) and coded 0. Host side, no compilation."""
    import numpy as np

    k = np.asarray(k, np.float32)
    heads, tokens, d = k.shape
    if bits not in BITS or d * bits % 8 or tokens % chunk_tokens:
        raise ValueError(f"cannot encode keys of shape {k.shape} at {bits} bits in chunks of {chunk_tokens} tokens")
    keys = np.ones(tokens, bool) if keys is None else np.asarray(keys, bool)
    if keys.shape != (tokens,):
        raise ValueError(f"keys must say of each of the {tokens} rows whether it is a key, got shape {keys.shape}")
    levels = (1 << bits) - 1
    c = k.reshape(heads, tokens // chunk_tokens, chunk_tokens, d)
    is_key = keys.reshape(1, tokens // chunk_tokens, chunk_tokens, 1)
    lo, hi = np.where(is_key, c, np.inf).min(axis=2), np.where(is_key, c, -np.inf).max(axis=2)
    held = is_key.any(axis=2)  # a chunk with no keys at all: its range is 0..0
    lo, hi = np.where(held, lo, 0), np.where(held, hi, 0)
    with np.errstate(over="ignore", invalid="ignore"):
        lo16, hi16 = lo.astype(np.float16), hi.astype(np.float16)
        lo16 = np.where(lo16.astype(np.float32) > lo, np.nextafter(lo16, np.float16(-np.inf)), lo16)
        hi16 = np.where(hi16.astype(np.float32) < hi, np.nextafter(hi16, np.float16(np.inf)), hi16)
    if not (np.isfinite(lo16).all() and np.isfinite(hi16).all()):
        raise ValueError("keys beyond float16's range (or not finite) cannot be stored at low precision")
    low, scale = range_scale(lo16.astype(np.float32), hi16.astype(np.float32), levels)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.clip(np.rint((c - low[:, :, None]) / safe[:, :, None]), 0, levels).astype(np.uint8) * is_key
    codes = codes.reshape(heads, tokens, d // (8 // bits), 8 // bits).astype(np.uint32)
    packed = (codes << (np.arange(8 // bits, dtype=np.uint32) * bits)).sum(axis=-1).astype(np.uint8)
    width = key_range_width(d, chunk_tokens)
    block = np.zeros((heads, tokens // chunk_tokens, chunk_tokens * width), np.uint8)
    block[..., :4 * d] = np.concatenate([lo16.view(np.uint8), hi16.view(np.uint8)], axis=-1)
    return packed, block.reshape(heads, tokens, width)


def range_scale(lo, hi, levels: int):
    """(zero point, step) of codes over [lo, hi] in float32; numpy or jnp alike, so that both sides agree."""
    return lo, (hi - lo) / levels


def key_ranges(ranges, *, head_dim: int, chunk_tokens: int):
    """A take of whole chunks' range rows `[H, C * chunk_tokens, w]` (bytes) -> (minimum, maximum) float32 [H, C,
    head_dim] of each chunk. Jittable."""
    ranges = as_bytes(ranges)
    heads, rows, width = ranges.shape
    block = ranges.reshape(heads, rows // chunk_tokens, chunk_tokens * width)[..., :4 * head_dim]
    halves = jax.lax.bitcast_convert_type(block.reshape(heads, -1, 2 * head_dim, 2), jnp.float16)
    halves = halves.astype(jnp.float32)
    return halves[..., :head_dim], halves[..., head_dim:]


def decode_key_codes(codes, lo, hi, chunk_of_row, *, bits: int, head_dim: int, dtype=jnp.float32):
    """Key rows `[H, n, >= head_dim * bits / 8]` (bytes: codes only, `encode_key_chunks`) -> `dtype` [H, n, head_dim],
    row i against the range of chunk `chunk_of_row[i]` of `lo` / `hi` [H, C, head_dim] (`key_ranges`); chunk_of_row
    [n], or [H, n] where each head's rows are its own. Jittable."""
    c = unpack(as_bytes(codes)[..., :head_dim * bits // 8], bits).astype(jnp.float32)
    chunks = jnp.broadcast_to(chunk_of_row, c.shape[:2])[..., None]
    low, step = range_scale(jnp.take_along_axis(lo, chunks, axis=1), jnp.take_along_axis(hi, chunks, axis=1),
                            (1 << bits) - 1)
    return (c * step + low).astype(dtype)
