"""Gathered attention: the computed tokens attend to a selected subset of the prefix KV plus,
causally, to themselves, flash-style.

The prefix KV is either one array per KV head ([H_kv, M, d]) or pages of whole chunks ([P, H_kv, C, d]: a device
pool's pages or a landing buffer as it crossed), which the kernels read in place through the selection's token
indices (a BlockTable's blocks are then page numbers).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from specjax.kernels import common as c
from specjax.kernels.common import SQUEEZED
from specjax.kernels.selections import Selection


# ----------------------------------------------------------------------------- kernels


def _prefix_rows(tokens, kv_head, *, num_tokens, pages):
    """Rows of the prefix refs holding `tokens` of KV head `kv_head`: the tokens themselves for that head's block
    [M, d]; for pages (`pages` = (kv_heads, chunk_tokens): the whole page array as rows [P * H_kv * C, d]) token t
    is row t % C of page t // C. Padding entries may hold anything: clipping keeps the gather in bounds."""
    tokens = jnp.clip(tokens, 0, num_tokens - 1)
    if pages is None:
        return tokens
    kv_heads, chunk = pages
    return ((tokens // chunk) * kv_heads + kv_head) * chunk + tokens % chunk


def _attention_kernel(q_ref, idx_ref, count_ref, k_ref, v_ref, own_k_ref, own_v_ref,
                      q_len_ref, o_ref, m_ref, l_ref, *, scale, block_q, block_k,
                      blocks_per_split, num_tokens, pages, group, pack):
    """One query tile over this split's selected tiles (+ causal own keys): of one query head, or with `pack` > 1 of
    a KV head's whole group (row r of the tile: token r // pack of query head r % pack of the group), which then
    loads each selected tile once for all of its query heads."""
    kv_head, q_block, split = pl.program_id(0) // group, pl.program_id(1), pl.program_id(2)
    count, q_len = count_ref[0], q_len_ref[0]
    q = q_ref[...]
    tokens_per_tile = block_q // pack
    rows = (q_block * block_q + jnp.arange(block_q)) // pack  # each row's token

    def attend(carry, keys, values, valid):
        m, l, acc = carry
        m, l, correction, p = c.online_softmax_step(m, l, c.dot_nt(q, keys) * scale, valid)
        return m, l, acc * correction[:, None] + c.dot_nn(p, values)

    def selected_tile(j, carry):
        tokens = _prefix_rows(idx_ref[pl.ds(j * block_k, block_k)], kv_head, num_tokens=num_tokens, pages=pages)
        valid = j * block_k + jnp.arange(block_k) < count
        # rows past the count may hold anything (a reused page, a landing buffer's tail): weight 0 times
        # a NaN is NaN, so their values are zeroed too
        values = jnp.where(valid[:, None], v_ref[tokens], jnp.zeros((), v_ref.dtype))
        return attend(carry, k_ref[tokens], values, valid[None, :])

    def own_tile(j, carry):  # own keys in tiles of block_k tokens
        own = pl.ds(j * block_k, block_k)
        valid = c.causal_valid(rows, j * block_k + jnp.arange(block_k), q_len)
        return attend(carry, own_k_ref[own, :], own_v_ref[own, :], valid)

    head_dim = q.shape[-1]
    carry = (jnp.full((block_q,), c.MASK_VALUE, jnp.float32),
             jnp.zeros((block_q,), jnp.float32),
             jnp.zeros((block_q, head_dim), jnp.float32))
    first = split * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, pl.cdiv(count, block_k))
    carry = lax.fori_loop(first, jnp.maximum(first, last), selected_tile, carry)
    # Split 0 also owns the causal keys (up to the tile's last token); other splits run this loop zero times.
    own_blocks = pl.cdiv(jnp.minimum((q_block + 1) * tokens_per_tile, q_len), block_k)
    m, l, acc = lax.fori_loop(0, jnp.where(split == 0, own_blocks, 0), own_tile, carry)
    o_ref[...] = acc / jnp.where(l > 0, l, 1.0)[:, None]
    m_ref[...], l_ref[...] = m, l


def packing(num_heads: int, num_kv: int, rows: int) -> int:
    """Query heads of a group packed into one tile (`gathered_attention_pallas`' `pack`): the group size rounded up
    to a power of two when every head reads the same selection (`rows` = 1) and the group has more than one head,
    else 1 (a tile per query head)."""
    group = num_heads // num_kv
    return 1 if rows > 1 or group == 1 else 1 << (group - 1).bit_length()


@functools.partial(jax.jit, static_argnames=(
    "scale", "block_q", "block_k", "k_splits", "interpret", "num_warps", "num_stages", "pack"))
def gathered_attention_pallas(q, prefix_k, prefix_v, own_k, own_v, idx, count, q_len, *,
                              scale, block_q, block_k, k_splits, interpret, num_warps=4, num_stages=2, pack=1):
    """Pallas gathered attention over token-index rows idx[R, K] (R = 1 shared, or H).

    count: int32[R] valid entries per row; q_len: int32 scalar. Both may be traced. prefix_k / prefix_v:
    [H_kv, M, d], or pages [P, H_kv, C, d] read in place (token t: row t % C of page t // C).

    pack: 1, a grid over query heads; or (a shared selection, R = 1) a power of two >= the group size, a grid over
    KV heads whose tiles hold block_q / pack tokens of every query head of the group (padded to `pack` heads), so a
    group's query heads share each load of the selected keys and values and the tile's matmuls are `pack` times
    taller (`packing` picks it).
    """
    num_heads, n_q, _ = q.shape
    num_kv = _prefix_geometry(prefix_k)[0]
    group = num_heads // num_kv
    if pack > 1 and (idx.shape[0] > 1 or pack < group or block_q % pack):
        raise ValueError(f"pack={pack} needs one shared selection row, a group of at most {pack} heads (got "
                         f"{group}) and block_q a multiple of it (got {block_q})")
    n_q_pad, k_pad = c.round_up(n_q, block_q // pack), c.round_up(idx.shape[1], block_k)
    q = c.pad_axis(q, 1, n_q_pad)
    own_k, own_v = (c.pad_axis(x, 1, c.round_up(n_q_pad, block_k)) for x in (own_k, own_v))
    kv_of = group  # program h reads KV head h // kv_of
    if pack > 1:
        q, kv_of = _packed(q, num_kv, pack), 1
    o_parts, m_parts, l_parts = _split_parts(
        q, c.pad_axis(idx, 1, k_pad), count, prefix_k, prefix_v, own_k, own_v,
        jnp.reshape(q_len, (1,)).astype(jnp.int32), scale=scale, block_q=block_q, block_k=block_k,
        k_splits=k_splits, kv_of=kv_of, pack=pack, interpret=interpret, num_warps=num_warps, num_stages=num_stages)
    _, _, out = c.merge_splits(m_parts, l_parts, o_parts)
    if pack > 1:
        out = _unpacked(out, num_heads, pack)
    return out[:, :n_q].astype(q.dtype)


def _split_parts(q, idx, count, prefix_k, prefix_v, own_k, own_v, q_len, *, scale, block_q, block_k, k_splits,
                 kv_of, pack, interpret, num_warps, num_stages):
    """The kernel's per-split partial outputs, row maxima and row sums ([k_splits, grid heads, rows(, d)]) for q
    [grid heads, rows, d] already padded (and packed) to whole query tiles, idx padded to whole key tiles and q_len
    int32[1]; program h of the grid reads KV head h // kv_of."""
    grid_heads, q_rows, head_dim = q.shape
    _, num_tokens, pages = _prefix_geometry(prefix_k)
    k_pad = idx.shape[1]
    rows_per_head = idx.shape[0] > 1
    params = None if interpret else c.triton_params(num_warps, num_stages)

    def row(h):  # which selection row head h reads
        return h if rows_per_head else h * 0

    if pages is None:  # each head's [M, d] block of prefix_k / prefix_v
        prefix_spec = pl.BlockSpec((SQUEEZED, num_tokens, head_dim), lambda h, *_: (h // kv_of, 0, 0))
    else:  # the pages as rows, every program reading its own KV head's (`_prefix_rows`)
        prefix_k, prefix_v = (x.reshape(-1, head_dim) for x in (prefix_k, prefix_v))
        prefix_spec = pl.BlockSpec(prefix_k.shape, lambda *_: (0, 0))

    return pl.pallas_call(
        functools.partial(_attention_kernel, scale=scale, block_q=block_q, block_k=block_k,
                          blocks_per_split=pl.cdiv(k_pad // block_k, k_splits), num_tokens=num_tokens, pages=pages,
                          group=kv_of, pack=pack),
        grid=(grid_heads, q_rows // block_q, k_splits),
        in_specs=[
            pl.BlockSpec((SQUEEZED, block_q, head_dim), lambda h, i, s: (h, i, 0)),
            pl.BlockSpec((SQUEEZED, k_pad), lambda h, i, s: (row(h), 0)),
            pl.BlockSpec((1,), lambda h, i, s: (row(h),)),
            prefix_spec,
            prefix_spec,
            pl.BlockSpec((SQUEEZED, own_k.shape[1], head_dim), lambda h, i, s: (h // kv_of, 0, 0)),
            pl.BlockSpec((SQUEEZED, own_k.shape[1], head_dim), lambda h, i, s: (h // kv_of, 0, 0)),
            pl.BlockSpec((1,), lambda h, i, s: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((SQUEEZED, SQUEEZED, block_q, head_dim),
                         lambda h, i, s: (s, h, i, 0)),
            pl.BlockSpec((SQUEEZED, SQUEEZED, block_q), lambda h, i, s: (s, h, i)),
            pl.BlockSpec((SQUEEZED, SQUEEZED, block_q), lambda h, i, s: (s, h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((k_splits, grid_heads, q_rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((k_splits, grid_heads, q_rows), jnp.float32),
            jax.ShapeDtypeStruct((k_splits, grid_heads, q_rows), jnp.float32),
        ],
        interpret=interpret, compiler_params=params,
        name=f"gathered_attention_bq{block_q}_bk{block_k}_p{pack}",
    )(q, idx, count, prefix_k, prefix_v, own_k, own_v, q_len)


def _packed(q, num_kv: int, pack: int):
    """q [H, n, d] -> [H_kv, n * pack, d]: row t * pack + g is token t of the group's query head g (heads past the
    group's are zeros)."""
    num_heads, n, d = q.shape
    q = jnp.swapaxes(c.pad_axis(q.reshape(num_kv, num_heads // num_kv, n, d), 1, pack), 1, 2)
    return q.reshape(num_kv, n * pack, d)


def _unpacked(out, num_heads: int, pack: int):
    """`_packed`'s inverse on the output [H_kv, n * pack, d] -> [H, n, d], the padding heads dropped."""
    num_kv, rows, d = out.shape
    out = jnp.swapaxes(out.reshape(num_kv, rows // pack, pack, d), 1, 2)[:, :num_heads // num_kv]
    return out.reshape(num_heads, rows // pack, d)


# ----------------------------------------------------------------------------- reference


class _Units(NamedTuple):
    """The reference attention's units: KV heads, each with its group of query heads (a shared selection), or query
    heads (per-head sets); and each unit's selected tokens."""

    shared: bool
    units: int
    per_unit: int
    kv_of_unit: jax.Array  # [U]
    tokens: jax.Array  # [R, K] token indices, clipped into the prefix
    counted: jax.Array  # [U, K] entries within their row's count


def _units(selection: Selection, num_heads: int, num_kv: int, num_tokens: int) -> _Units:
    idx, count = selection.token_indices(num_heads)
    shared = idx.shape[0] == 1
    units, per_unit = (num_kv, num_heads // num_kv) if shared else (num_heads, 1)
    kv_of_unit = jnp.arange(units) if shared else jnp.arange(num_heads) // (num_heads // num_kv)
    counted = jnp.arange(idx.shape[1])[None, :] < count[:, None]
    return _Units(shared, units, per_unit, kv_of_unit, jnp.clip(idx, 0, num_tokens - 1),
                  jnp.broadcast_to(counted, (units, idx.shape[1])))


def _with_own(prefix, own, u: _Units, pages, masked=False):
    """[U, K + n_q, d] float32: each unit's selected rows of `prefix` ([H_kv, M, d], or pages [P, H_kv, C, d]), then
    its KV head's rows of `own`."""
    if pages is not None:  # token t at page t // C, row t % C: the pages' rows in token order, per KV head
        prefix = jnp.swapaxes(prefix, 0, 1).reshape(pages[0], -1, prefix.shape[-1])
    rows = prefix[:, u.tokens[0]] if u.shared else prefix[u.kv_of_unit[:, None], u.tokens]
    if masked:  # pages past the count may hold anything: a value there times its weight 0 must not give NaN
        rows = jnp.where(u.counted[..., None], rows, jnp.zeros((), prefix.dtype))
    return jnp.concatenate([rows, own[u.kv_of_unit]], axis=1).astype(jnp.float32)


def _weigh(scores, values, u: _Units, q_len):
    """Scaled scores [U, per_unit, n_q, K + n_q] (the selected rows', then the computed tokens') masked, softmaxed and
    applied to values [U, K + n_q, d] -> [U, per_unit, n_q, d]."""
    n_q, capacity = scores.shape[2], u.counted.shape[1]
    rows = jnp.arange(n_q)
    selected_valid = u.counted[:, None, None, :] & (rows < q_len)[None, None, :, None]
    own_valid = jnp.broadcast_to(c.causal_valid(rows, rows, q_len), (u.units, 1, n_q, n_q))
    valid = jnp.concatenate([jnp.broadcast_to(selected_valid, (u.units, 1, n_q, capacity)), own_valid], axis=-1)
    weights = jax.nn.softmax(jnp.where(valid, scores, c.MASK_VALUE), axis=-1)
    weights = jnp.where(valid, weights, 0.0)
    return jnp.einsum("ugqk,ukd->ugqd", weights, values, precision=lax.Precision.HIGHEST)


@functools.partial(jax.jit, static_argnames=("scale",))
def gathered_attention_reference(q, prefix_k, prefix_v, own_k, own_v, selection: Selection, *,
                                 q_len=None, scale=None):
    """Plain jnp: gathers the selected K/V and materialises the softmax over them and the causal own keys.

    A shared selection (SharedIndices, BlockTable) gathers each KV head's rows once and attends with the group's query
    heads together ([H_kv, group, n_q, ...]); per-head sets gather each query head's own rows ([H, 1, n_q, ...])."""
    num_heads, n_q, head_dim = q.shape
    num_kv, num_tokens, pages = _prefix_geometry(prefix_k)
    scale = c.default_scale(head_dim, scale)
    u = _units(selection, num_heads, num_kv, num_tokens)
    keys = _with_own(prefix_k, own_k, u, pages)  # a key past the count is masked out of the scores
    values = _with_own(prefix_v, own_v, u, pages, masked=pages is not None)
    queries = q.astype(jnp.float32).reshape(u.units, u.per_unit, n_q, head_dim)
    scores = jnp.einsum("ugqd,ukd->ugqk", queries, keys, precision=lax.Precision.HIGHEST) * scale
    out = _weigh(scores, values, u, c.length_or_full(q_len, n_q))
    return out.reshape(num_heads, n_q, head_dim).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale",))
def attention_over_logits(logits, columns: Selection, prefix_v, own_v, selection: Selection, *, q_len=None,
                          scale=None):
    """gathered_attention_reference's attention with its logits taken, not computed: `logits` f32 [H, n_q, M' + n_q]
    are every query head's unscaled logits over M' scored prefix rows and then the n_q computed tokens (the scoring
    pass's, `probe_scores_reference(..., with_logits=True)`), and `columns` (a selection shaped like `selection`,
    entry for entry) names the column of each selected row. Only the selected values are gathered and weighed: the
    attention costs its rows' values, the keys' products having been paid once by the scoring. Returns f32
    [H, n_q, d], bit for bit the reference's on a CPU (tests/test_kernels_gathered_attention.py).

    It pays where each query head has a set of its own (per-head H2O: the reference then multiplies each head's
    queries by keys gathered for it alone); a shared set's keys are one product per KV head, which costs less
    than picking its columns out of the logits.

    prefix_v [H_kv, M, d] (the rows `selection` indexes), own_v [H_kv, n_q, d]; as gathered_attention_reference."""
    num_heads, n_q, width = logits.shape
    num_kv, num_tokens, head_dim = prefix_v.shape
    scale = c.default_scale(head_dim, scale)
    u = _units(selection, num_heads, num_kv, num_tokens)
    cols = jnp.clip(columns.token_indices(num_heads)[0], 0, width - n_q - 1)
    # [H, n_q, K]: every head's logits at the one set's columns, or at its own
    picked = logits[:, :, cols[0]] if u.shared else jnp.take_along_axis(logits, cols[:, None, :], axis=2)
    scores = jnp.concatenate([picked, logits[:, :, width - n_q:]], -1).reshape(u.units, u.per_unit, n_q, -1) * scale
    out = _weigh(scores, _with_own(prefix_v, own_v, u, None), u, c.length_or_full(q_len, n_q))
    return out.reshape(num_heads, n_q, head_dim)


# ----------------------------------------------------------------------------- public


def gathered_attention(q, prefix_k, prefix_v, own_k, own_v, selection: Selection, *,
                       q_len=None, scale: float | None = None, impl: str = "auto", block_q: int | None = None,
                       block_k: int | None = None, k_splits: int | None = None,
                       check_indices: bool = True, pack_heads: bool = True):
    """Attention of the computed tokens over the selected prefix KV and, causally, themselves.

    Args:
      q: [H, n_q, d] unscaled queries of the computed tokens (new prefix tokens + query).
      prefix_k, prefix_v: [H_kv, M, d] prefix keys (already position-encoded) and values;
        the selection indexes their token axis M (M may be a whole device cache pool). Or pages
        [P, H_kv, C, d], read where they are (a device pool's pages, a landing buffer of whole
        chunks): token t is row t % C of page t // C, so a BlockTable's blocks are page numbers
        and M = P * C. Rows the selection does not count may hold anything.
      own_k, own_v: [H_kv, n_q, d] keys and values of the computed tokens.
      selection: SharedIndices, PerHeadIndices or BlockTable (see selections.py).
      q_len: valid query rows (may be traced); outputs of later rows are don't-care.
      scale: softmax scale, default d ** -0.5.
      impl: "auto" (Pallas on GPU, reference elsewhere), "pallas" or "reference".
      block_q, block_k, k_splits: Pallas tiling (powers of two; None picks defaults). block_q counts a tile's query
        rows: with a shared selection (SharedIndices, BlockTable) and grouped-query heads, a tile holds block_q /
        pack tokens of each of a KV head's query heads (`packing`; one tile per query head where block_q < pack).
      check_indices: reject duplicate / out-of-range concrete indices (syncs with the device).
      pack_heads: pack a group's query heads in one tile where the selection allows (False: a tile per query head,
        for comparison).

    Query head h reads KV head h // (H // H_kv).
    """
    _check_attention_args(q, prefix_k, prefix_v, own_k, own_v)
    num_heads, n_q, head_dim = q.shape
    num_kv, num_tokens, _ = _prefix_geometry(prefix_k)
    selection.check(num_heads, num_tokens, check_indices)
    c.check_length("q_len", q_len, n_q)
    scale = c.default_scale(head_dim, scale)
    if num_tokens == 0:  # nothing to gather from: a zero row (a zero page) keeps the gathers well formed
        prefix_k, prefix_v = (c.pad_axis(x, 0 if x.ndim == 4 else 1, 1) for x in (prefix_k, prefix_v))
    dispatch = c.resolve_impl(impl)
    if not dispatch.use_pallas:
        return gathered_attention_reference(q, prefix_k, prefix_v, own_k, own_v, selection,
                                            q_len=q_len, scale=scale)
    interpret = dispatch.interpret
    idx, count = selection.token_indices(num_heads)
    pack = packing(num_heads, num_kv, idx.shape[0]) if pack_heads else 1
    if block_q is not None and block_q < pack:  # a tile too short for the group: one per query head
        pack = 1
    block_q, block_k, k_splits = c.pallas_tiling(n_q * pack, idx.shape[1], num_kv if pack > 1 else num_heads,
                                                 head_dim, block_q, block_k, k_splits, interpret=interpret)
    if block_q < pack:  # the default tile is capped below the group's size
        pack = 1
    return gathered_attention_pallas(
        q, prefix_k, prefix_v, own_k, own_v, idx, count, c.length_or_full(q_len, n_q),
        scale=scale, block_q=block_q, block_k=block_k, k_splits=k_splits, interpret=interpret, pack=pack)


def _prefix_geometry(prefix) -> tuple[int, int, tuple[int, int] | None]:
    """(KV heads, tokens, None) of prefix arrays [H_kv, M, d]; (KV heads, P * C, (KV heads, C)) of pages [P, H_kv, C,
    d]."""
    if prefix.ndim == 4:
        pages, kv_heads, chunk = prefix.shape[:3]
        return kv_heads, pages * chunk, (kv_heads, chunk)
    return prefix.shape[0], prefix.shape[1], None


def _check_attention_args(q, prefix_k, prefix_v, own_k, own_v) -> None:
    c.check_rank("q", q, 3, "[H, n_q, d]")
    if jnp.ndim(prefix_k) != 4:
        c.check_rank("prefix_k", prefix_k, 3, "[H_kv, M, d] or pages [P, H_kv, C, d]")
    num_heads, n_q, head_dim = q.shape
    num_kv = _prefix_geometry(prefix_k)[0]
    if (jnp.shape(prefix_v) != prefix_k.shape or prefix_k.shape[-1] != head_dim
            or jnp.shape(own_k) != (num_kv, n_q, head_dim) or jnp.shape(own_v) != own_k.shape):
        raise ValueError(
            f"shapes disagree: q {q.shape}, prefix_k {prefix_k.shape}, prefix_v "
            f"{jnp.shape(prefix_v)}, own_k {jnp.shape(own_k)}, own_v {jnp.shape(own_v)}; want "
            "q [H, n_q, d], prefix_k/v [H_kv, M, d] or pages [P, H_kv, C, d], own_k/v [H_kv, n_q, d].")
    if num_kv == 0 or num_heads % num_kv:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv} KV heads evenly.")
