"""Gathered attention over low-bit prefix KV as a store holds it (store format 3), dequantised inside the attention.

Keys are codes only, each against its chunk's per-channel range (`quant.encode_key_chunks`: the store's low-bit K
kind, and its `krange` kind, whole chunks); values are rows that decode alone (codes, then each channel group's
float16 scale and zero point, `quant.encode_rows`).

The Pallas kernel never widens a row in memory: a byte of codes holds `8 / bits` channels, read as that many planes
(plane s: the s-th code of every byte, channels s, s + 8 / bits, ...), and the queries, the chunks' ranges and the
computed tokens' K/V are put in plane order before it runs. A tile's keys are decoded in registers, each row against
its chunk's minimum and step (gathered by token // chunk_tokens from the ranges, a few KiB per head); the values'
planes are weighed by p * scale_g, and their zero points by sum(p * zero_g), which are added back per channel once
the softmax is done. The reference gathers the selected rows, decodes them as the engine does
(`quant.decode_key_codes`, `quant.decode_rows`) and runs `gathered_attention_reference` over them.

    out = low_bit_attention(q, k_codes, k_ranges, v_rows, own_k, own_v, selection, bits=4, group=32,
                            chunk_tokens=64)
    # k_codes, k_ranges, v_rows [H_kv, M, w_*] of any dtype whose bytes they are (M whole chunks)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from specjax.kernels import common as c
from specjax.kernels import quant
from specjax.kernels.common import SQUEEZED
from specjax.kernels.gathered_attention import gathered_attention_reference
from specjax.kernels.selections import PerHeadIndices, Selection, SharedIndices


def plane_order(head_dim: int, bits: int) -> np.ndarray:
    """Channel permutation into plane order: position s * (head_dim * bits / 8) + j holds channel j * (8 / bits) + s."""
    planes = 8 // bits
    return np.concatenate([np.arange(s, head_dim, planes) for s in range(planes)])


# ----------------------------------------------------------------------------- reference


@functools.partial(jax.jit, static_argnames=("bits", "group", "chunk_tokens", "scale"))
def low_bit_attention_reference(q, k_codes, k_ranges, v_rows, own_k, own_v, selection: Selection, *, bits, group,
                                chunk_tokens, q_len=None, scale=None):
    """The selected rows gathered, decoded (float32, as the engine decodes a take) and attended by
    `gathered_attention_reference`; a per-head selection attends over each query head's own gathered rows."""
    num_heads, n_q, head_dim = q.shape
    num_kv, num_tokens = k_codes.shape[:2]
    idx, count = selection.token_indices(num_heads)
    idx = jnp.clip(idx, 0, num_tokens - 1)
    lo, hi = quant.key_ranges(k_ranges, head_dim=head_dim, chunk_tokens=chunk_tokens)
    k_codes, v_rows = quant.as_bytes(k_codes), quant.as_bytes(v_rows)

    def decode(k, v, tokens, lo, hi):
        keys = quant.decode_key_codes(k, lo, hi, tokens // chunk_tokens, bits=bits, head_dim=head_dim)
        return keys, quant.decode_rows(v, bits=bits, group=group, head_dim=head_dim)

    if idx.shape[0] == 1:  # one set: each KV head's rows gathered once
        keys, values = decode(jnp.take(k_codes, idx[0], axis=1), jnp.take(v_rows, idx[0], axis=1), idx[0], lo, hi)
        gathered = SharedIndices(jnp.arange(idx.shape[1], dtype=jnp.int32), count[0])
        return gathered_attention_reference(q, keys, values, own_k, own_v, gathered, q_len=q_len, scale=scale)
    kv_of_head = jnp.arange(num_heads) // (num_heads // num_kv)  # each query head its own rows, as a KV head of its own
    keys, values = decode(k_codes[kv_of_head[:, None], idx], v_rows[kv_of_head[:, None], idx], idx,
                          lo[kv_of_head], hi[kv_of_head])
    gathered = PerHeadIndices(jnp.broadcast_to(jnp.arange(idx.shape[1], dtype=jnp.int32), idx.shape), count)
    return gathered_attention_reference(q, keys, values, own_k[kv_of_head], own_v[kv_of_head], gathered,
                                        q_len=q_len, scale=scale)


# ----------------------------------------------------------------------------- kernel


def _code_planes(codes, bits: int) -> list:
    """A tile's code bytes [block_k, w] as float32 code planes (plane s: the s-th `bits`-bit code of every byte)."""
    codes = codes.astype(jnp.int32)
    return [((codes >> (s * bits)) & ((1 << bits) - 1)).astype(jnp.float32) for s in range(8 // bits)]


def _scale_and_zero(scales, g: int):
    """Channel group g's scale and zero point ([block_k] each) from scales [block_k, 2 * groups] (every group's
    scale, then every group's zero point), picked by a reduction: a kernel avoids indexing the minor axis."""
    groups = scales.shape[-1] // 2
    column = lax.broadcasted_iota(jnp.int32, (1, 2 * groups), 1)
    return ((scales * (column == g)).sum(axis=1), (scales * (column == groups + g)).sum(axis=1))


def _low_bit_scores(qp: list, k_planes: list, k_low: list, k_step: list):
    """Scores [block_q, block_k] of the query planes against a tile of low-bit keys, each code plane decoded in
    registers against its rows' chunk minimum and step (lists of [block_k, width], plane by plane)."""
    return sum(c.dot_nt(x, y * step + low) for x, y, low, step in zip(qp, k_planes, k_low, k_step))


def _add_low_bit_values(acc: list, zacc: list, p, in_group: list, v_planes: list, v_scales) -> tuple[list, list]:
    """The accumulators plus a tile of low-bit values weighed by the softmax weights p [block_q, block_k]: each
    plane's acc gains its codes weighed by p * scale_g in group g's columns, and zacc[g] gains sum(p * zero_g)."""
    zacc = list(zacc)
    for g, member in enumerate(in_group):
        v_scale, v_zero = _scale_and_zero(v_scales, g)
        weighed = p * v_scale[None, :]
        acc = [a + c.dot_nn(weighed, y) * member for a, y in zip(acc, v_planes)]
        zacc[g] = zacc[g] + (p * v_zero[None, :]).sum(axis=1)
    return acc, zacc


def _kernel(q_ref, idx_ref, count_ref, kc_ref, kr_ref, vc_ref, vs_ref, own_k_ref, own_v_ref, q_len_ref,
            o_ref, z_ref, m_ref, l_ref, *, scale, block_q, block_k, blocks_per_split, num_tokens, bits, groups,
            chunk_tokens):
    """One query tile of one query head over this split's selected tiles of low-bit rows (+ causal own keys), every
    channel in plane order (module docstring)."""
    q_block, split = pl.program_id(1), pl.program_id(2)
    count, q_len = count_ref[0], q_len_ref[0]
    head_dim = o_ref.shape[-1]
    planes, width = 8 // bits, head_dim // (8 // bits)
    qp = [q_ref[:, pl.ds(s * width, width)].astype(jnp.float32) for s in range(planes)]
    group_of = lax.broadcasted_iota(jnp.int32, (1, width), 1) // (width // groups)  # each plane column's group
    in_group = [(group_of == g).astype(jnp.float32) for g in range(groups)]
    rows = q_block * block_q + jnp.arange(block_q)

    def selected_tile(j, carry):
        m, l, acc, zacc = carry
        tokens = jnp.clip(idx_ref[pl.ds(j * block_k, block_k)], 0, num_tokens - 1)
        valid = j * block_k + jnp.arange(block_k) < count
        k_planes, v_planes = _code_planes(kc_ref[tokens], bits), _code_planes(vc_ref[tokens], bits)
        chunks = tokens // chunk_tokens
        k_low = [kr_ref[chunks, pl.ds(s * width, width)] for s in range(planes)]
        k_step = [kr_ref[chunks, pl.ds(head_dim + s * width, width)] for s in range(planes)]
        v_scales = jnp.where(valid[:, None], vs_ref[tokens], 0.0)
        scores = _low_bit_scores(qp, k_planes, k_low, k_step)
        m, l, correction, p = c.online_softmax_step(m, l, scores * scale, valid[None, :])
        acc = [a * correction[:, None] for a in acc]
        zacc = [z * correction for z in zacc]
        acc, zacc = _add_low_bit_values(acc, zacc, p, in_group, v_planes, v_scales)
        return m, l, acc, zacc

    def own_tile(j, carry):  # the computed tokens' own K/V, full precision, in tiles of block_k tokens
        m, l, acc, zacc = carry
        own = pl.ds(j * block_k, block_k)
        valid = c.causal_valid(rows, j * block_k + jnp.arange(block_k), q_len)
        scores = sum(c.dot_nt(x, own_k_ref[own, pl.ds(s * width, width)].astype(jnp.float32))
                     for s, x in enumerate(qp))
        m, l, correction, p = c.online_softmax_step(m, l, scores * scale, valid)
        acc = [a * correction[:, None] + c.dot_nn(p, own_v_ref[own, pl.ds(s * width, width)].astype(jnp.float32))
               for s, a in enumerate(acc)]
        return m, l, acc, [z * correction for z in zacc]

    carry = (jnp.full((block_q,), c.MASK_VALUE, jnp.float32), jnp.zeros((block_q,), jnp.float32),
             [jnp.zeros((block_q, width), jnp.float32) for _ in range(planes)],
             [jnp.zeros((block_q,), jnp.float32) for _ in range(groups)])
    first = split * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, pl.cdiv(count, block_k))
    carry = lax.fori_loop(first, jnp.maximum(first, last), selected_tile, carry)
    own_blocks = pl.cdiv(jnp.minimum((q_block + 1) * block_q, q_len), block_k)
    m, l, acc, zacc = lax.fori_loop(0, jnp.where(split == 0, own_blocks, 0), own_tile, carry)
    safe = jnp.where(l > 0, l, 1.0)
    for s, a in enumerate(acc):
        o_ref[:, pl.ds(s * width, width)] = a / safe[:, None]
    for g, z in enumerate(zacc):
        z_ref[g] = z / safe
    m_ref[...], l_ref[...] = m, l


@functools.partial(jax.jit, static_argnames=("bits", "group", "chunk_tokens", "scale", "block_q", "block_k", "k_splits",
                                             "interpret", "num_warps", "num_stages"))
def low_bit_attention_pallas(q, k_codes, k_ranges, v_rows, own_k, own_v, idx, count, q_len, *, bits, group,
                             chunk_tokens, scale, block_q, block_k, k_splits, interpret, num_warps=4, num_stages=2):
    """Pallas attention over idx[R, K]'s low-bit rows (R = 1 shared, or H), a grid over query heads.

    k_codes, k_ranges, v_rows: the store's low-bit K, its chunks' ranges and low-bit V rows [H_kv, M, w_*]; own_k,
    own_v [H_kv, n_q, d] at full precision; count int32[R]; q_len int32 scalar."""
    num_heads, n_q, head_dim = q.shape
    num_kv, num_tokens = k_codes.shape[:2]
    group_heads, groups = num_heads // num_kv, head_dim // group
    rows_per_head = idx.shape[0] > 1
    order = plane_order(head_dim, bits)
    kc = quant.as_bytes(k_codes)[..., :head_dim * bits // 8]
    low, step = quant.range_scale(*quant.key_ranges(k_ranges, head_dim=head_dim, chunk_tokens=chunk_tokens),
                                  (1 << bits) - 1)
    kr = jnp.concatenate([low[..., order], step[..., order]], axis=-1)  # [H_kv, chunks, 2 * d], plane order
    vc, vs = quant.row_parts(v_rows, bits=bits, group=group, head_dim=head_dim)
    n_q_pad, k_pad = c.round_up(n_q, block_q), c.round_up(idx.shape[1], block_k)
    q = c.pad_axis(q[..., order], 1, n_q_pad)
    own_k, own_v = (c.pad_axis(x[..., order], 1, c.round_up(n_q_pad, block_k)) for x in (own_k, own_v))
    idx = c.pad_axis(idx, 1, k_pad)
    q_len = jnp.reshape(q_len, (1,)).astype(jnp.int32)
    q_blocks, k_blocks = n_q_pad // block_q, k_pad // block_k
    blocks_per_split = pl.cdiv(k_blocks, k_splits)

    def row(h):
        return h if rows_per_head else h * 0

    def per_kv_head(x):
        return pl.BlockSpec((SQUEEZED,) + x.shape[1:], lambda h, i, s: (h // group_heads, 0, 0))

    o_parts, z_parts, m_parts, l_parts = pl.pallas_call(
        functools.partial(_kernel, scale=scale, block_q=block_q, block_k=block_k, blocks_per_split=blocks_per_split,
                          num_tokens=num_tokens, bits=bits, groups=groups, chunk_tokens=chunk_tokens),
        grid=(num_heads, q_blocks, k_splits),
        in_specs=[
            pl.BlockSpec((SQUEEZED, block_q, head_dim), lambda h, i, s: (h, i, 0)),
            pl.BlockSpec((SQUEEZED, k_pad), lambda h, i, s: (row(h), 0)),
            pl.BlockSpec((1,), lambda h, i, s: (row(h),)),
            per_kv_head(kc), per_kv_head(kr), per_kv_head(vc), per_kv_head(vs), per_kv_head(own_k),
            per_kv_head(own_v),
            pl.BlockSpec((1,), lambda h, i, s: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((SQUEEZED, SQUEEZED, block_q, head_dim), lambda h, i, s: (s, h, i, 0)),
            pl.BlockSpec((SQUEEZED, SQUEEZED, groups, block_q), lambda h, i, s: (s, h, 0, i)),
            pl.BlockSpec((SQUEEZED, SQUEEZED, block_q), lambda h, i, s: (s, h, i)),
            pl.BlockSpec((SQUEEZED, SQUEEZED, block_q), lambda h, i, s: (s, h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((k_splits, num_heads, n_q_pad, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((k_splits, num_heads, groups, n_q_pad), jnp.float32),
            jax.ShapeDtypeStruct((k_splits, num_heads, n_q_pad), jnp.float32),
            jax.ShapeDtypeStruct((k_splits, num_heads, n_q_pad), jnp.float32),
        ],
        interpret=interpret, compiler_params=None if interpret else c.triton_params(num_warps, num_stages),
        name=f"low_bit_attention_b{bits}_bq{block_q}_bk{block_k}",
    )(q, idx, count, kc, kr, vc, vs, own_k, own_v, q_len)
    # the splits' planes and zero-point sums merged alike, then each channel its plane column plus its group's zeros
    both = jnp.concatenate([o_parts, jnp.swapaxes(z_parts, 2, 3)], axis=-1)
    _, _, merged = c.merge_splits(m_parts, l_parts, both)
    planes, zeros = merged[..., :head_dim], merged[..., head_dim:]
    out = planes[..., np.argsort(order)] + jnp.repeat(zeros, group, axis=-1)
    return out[:, :n_q].astype(q.dtype)


# ----------------------------------------------------------------------------- public


def low_bit_attention(q, k_codes, k_ranges, v_rows, own_k, own_v, selection: Selection, *, bits: int, group: int,
                      chunk_tokens: int, q_len=None, scale: float | None = None, impl: str = "auto",
                      block_q: int | None = None, block_k: int | None = None, k_splits: int | None = None):
    """`gathered_attention` over a store's low-bit prefix: q [H, n_q, d]; k_codes [H_kv, M, w_k] key codes and
    k_ranges [H_kv, M, w_r] their chunks' ranges (`quant.encode_key_chunks` over chunks of `chunk_tokens`, M whole
    chunks); v_rows [H_kv, M, w_v] value rows (`quant.encode_rows`, `group` channels a scale), each of any dtype whose
    bytes they are; own_k, own_v [H_kv, n_q, d]; selection SharedIndices, PerHeadIndices or BlockTable over M (pages
    are not read at low precision).
    impl as `gathered_attention`'s: Pallas on a GPU (interpret mode when asked for on a CPU), the reference
    elsewhere."""
    if any(jnp.ndim(x) != 3 for x in (k_codes, k_ranges, v_rows)):
        raise ValueError(f"low-bit rows are read as [H_kv, M, w] arrays through token indices, got shapes "
                         f"{jnp.shape(k_codes)}, {jnp.shape(k_ranges)}, {jnp.shape(v_rows)} (pages are not read at "
                         f"low precision)")
    num_heads, n_q, head_dim = q.shape
    num_kv, num_tokens = k_codes.shape[:2]
    if bits not in quant.BITS or group < 1 or head_dim % group or group * bits % 8:
        raise ValueError(f"{bits}-bit rows in groups of {group} channels do not fit {head_dim} channels")
    if chunk_tokens < 1 or num_tokens % chunk_tokens:
        raise ValueError(f"{num_tokens} prefix tokens are not whole chunks of {chunk_tokens}")

    def nbytes(x):
        return x.shape[-1] * jnp.dtype(x.dtype).itemsize

    need = {"k_codes": head_dim * bits // 8, "k_ranges": quant.key_range_width(head_dim, chunk_tokens),
            "v_rows": quant.row_nbytes(head_dim, bits, group)}
    for name, x in zip(need, (k_codes, k_ranges, v_rows)):
        if x.shape[:2] != (num_kv, num_tokens) or nbytes(x) < need[name]:
            raise ValueError(f"{name} {x.shape} ({x.dtype}) must be [{num_kv}, {num_tokens}, w] with rows of at "
                             f"least {need[name]} bytes ({head_dim} channels at {bits} bits)")
    if jnp.shape(own_k) != (num_kv, n_q, head_dim) or jnp.shape(own_v) != jnp.shape(own_k):
        raise ValueError(f"own_k / own_v must be [{num_kv}, {n_q}, {head_dim}], got {jnp.shape(own_k)}, "
                         f"{jnp.shape(own_v)}")
    selection.check(num_heads, num_tokens, True)
    c.check_length("q_len", q_len, n_q)
    scale = c.default_scale(head_dim, scale)
    dispatch = c.resolve_impl(impl)
    if not dispatch.use_pallas:
        return low_bit_attention_reference(q, k_codes, k_ranges, v_rows, own_k, own_v, selection, bits=bits,
                                           group=group, chunk_tokens=chunk_tokens, q_len=q_len, scale=scale)
    idx, count = selection.token_indices(num_heads)
    block_q, block_k, k_splits = c.pallas_tiling(n_q, idx.shape[1], num_heads, head_dim, block_q, block_k, k_splits,
                                                 interpret=dispatch.interpret)
    return low_bit_attention_pallas(q, k_codes, k_ranges, v_rows, own_k, own_v, idx, count,
                                    c.length_or_full(q_len, n_q), bits=bits, group=group, chunk_tokens=chunk_tokens,
                                    scale=scale, block_q=block_q, block_k=block_k, k_splits=k_splits,
                                    interpret=dispatch.interpret)
