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
