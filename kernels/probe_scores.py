"""Probe scoring: H2O importance of every prefix token for a few probe heads (docs/systems.md, H2O and ITF).

Two passes so that no [n_q, m] matrix is ever stored: row log-sum-exp over prefix + causal
computed keys, then column sums of the softmax weights over the prefix keys.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from specjax.kernels import common as c
from specjax.kernels.common import SQUEEZED


# ----------------------------------------------------------------------------- kernels


def _row_stats_kernel(q_ref, prefix_k_ref, own_k_ref, lens_ref, m_ref, l_ref, *,
                      scale, block_q, block_k, blocks_per_split):
    """Pass 1: running row max / row sum over this split's prefix tiles (+ own keys)."""
    q_block, split = pl.program_id(1), pl.program_id(2)
    prefix_len, q_len = lens_ref[0], lens_ref[1]
    q = q_ref[...]
    rows = q_block * block_q + jnp.arange(block_q)

    def prefix_tile(j, carry):
        keys = prefix_k_ref[pl.ds(j * block_k, block_k), :]
        cols = j * block_k + jnp.arange(block_k)
        valid = (cols < prefix_len)[None, :]
        m, l, _, _ = c.online_softmax_step(*carry, c.dot_nt(q, keys) * scale, valid)
        return m, l

    def own_tile(j, carry):
        keys = own_k_ref[pl.ds(j * block_q, block_q), :]
        cols = j * block_q + jnp.arange(block_q)
        valid = c.causal_valid(rows, cols, q_len)
        m, l, _, _ = c.online_softmax_step(*carry, c.dot_nt(q, keys) * scale, valid)
        return m, l

    carry = (jnp.full((block_q,), c.MASK_VALUE, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    first = split * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, pl.cdiv(prefix_len, block_k))
    carry = lax.fori_loop(first, jnp.maximum(first, last), prefix_tile, carry)
    # Split 0 also owns the causal keys; other splits run this loop zero times.
    own_blocks = jnp.minimum(q_block + 1, pl.cdiv(q_len, block_q))
    carry = lax.fori_loop(0, jnp.where(split == 0, own_blocks, 0), own_tile, carry)
    m_ref[...], l_ref[...] = carry


def _column_sums_kernel(q_ref, lse_ref, prefix_k_ref, lens_ref, out_ref, *,
                        scale, block_q, block_k):
    """Pass 2: importance of one tile of prefix keys = column sums over all query rows."""
    prefix_len, q_len = lens_ref[0], lens_ref[1]
    first_col = pl.program_id(1) * block_k
    col_valid = first_col + jnp.arange(block_k) < prefix_len
    out_ref[...] = c.column_sums(q_ref, lse_ref, prefix_k_ref[...], col_valid,
                                 first_col < prefix_len, q_len, scale=scale, block_q=block_q)


def _kv_head_map(kv_head_of_probe: tuple[int, ...]):
    """Probe index -> KV head inside a BlockSpec index map (which cannot close over arrays)."""

    def kv_head(p):
        head = p * 0 + kv_head_of_probe[0]
        for probe, kv in enumerate(kv_head_of_probe[1:], start=1):
            head = jnp.where(p == probe, kv, head)
        return head

    return kv_head


@functools.partial(jax.jit, static_argnames=(
    "kv_head_of_probe", "scale", "block_q", "block_k", "k_splits", "interpret",
    "num_warps", "num_stages"))
def probe_scores_pallas(q, prefix_k, own_k, prefix_len, q_len, *, kv_head_of_probe, scale,
                        block_q, block_k, k_splits, interpret, num_warps=4, num_stages=2):
    """Pallas probe scoring; lengths are int32 scalars (traced is fine), the rest static."""
    num_probes, n_q, head_dim = q.shape
    m = prefix_k.shape[1]
    n_q_pad, m_pad = c.round_up(n_q, block_q), c.round_up(m, block_k)
    # Padding copies; the engine's buckets are block multiples, so it normally does not.
    q, own_k = c.pad_axis(q, 1, n_q_pad), c.pad_axis(own_k, 1, n_q_pad)
    prefix_k = c.pad_axis(prefix_k, 1, m_pad)
    lens = jnp.stack([prefix_len, q_len]).astype(jnp.int32)
    q_blocks, k_blocks = n_q_pad // block_q, m_pad // block_k
    blocks_per_split = pl.cdiv(k_blocks, k_splits)
    kv_head = _kv_head_map(kv_head_of_probe)
    params = None if interpret else c.triton_params(num_warps, num_stages)

    stats_shape = jax.ShapeDtypeStruct((k_splits, num_probes, n_q_pad), jnp.float32)
    stats_spec = pl.BlockSpec((SQUEEZED, SQUEEZED, block_q), lambda p, i, s: (s, p, i))
    m_parts, l_parts = pl.pallas_call(
        functools.partial(_row_stats_kernel, scale=scale, block_q=block_q,
                          block_k=block_k, blocks_per_split=blocks_per_split),
        grid=(num_probes, q_blocks, k_splits),
        in_specs=[
            pl.BlockSpec((SQUEEZED, block_q, head_dim), lambda p, i, s: (p, i, 0)),
            pl.BlockSpec((SQUEEZED, m_pad, head_dim), lambda p, i, s: (kv_head(p), 0, 0)),
            pl.BlockSpec((SQUEEZED, n_q_pad, head_dim), lambda p, i, s: (kv_head(p), 0, 0)),
            pl.BlockSpec((2,), lambda p, i, s: (0,)),
        ],
        out_specs=[stats_spec, stats_spec],
        out_shape=[stats_shape, stats_shape],
        interpret=interpret, compiler_params=params,
        name=f"probe_row_stats_bq{block_q}_bk{block_k}",
    )(q, prefix_k, own_k, lens)
    lse = c.log_sum_exp(*c.merge_splits(m_parts, l_parts))

    scores = pl.pallas_call(
        functools.partial(_column_sums_kernel, scale=scale, block_q=block_q, block_k=block_k),
        grid=(num_probes, k_blocks),
        in_specs=[
            pl.BlockSpec((SQUEEZED, n_q_pad, head_dim), lambda p, j: (p, 0, 0)),
            pl.BlockSpec((SQUEEZED, n_q_pad), lambda p, j: (p, 0)),
            pl.BlockSpec((SQUEEZED, block_k, head_dim), lambda p, j: (kv_head(p), j, 0)),
            pl.BlockSpec((2,), lambda p, j: (0,)),
        ],
        out_specs=pl.BlockSpec((SQUEEZED, block_k), lambda p, j: (p, j)),
        out_shape=jax.ShapeDtypeStruct((num_probes, m_pad), jnp.float32),
        interpret=interpret, compiler_params=params,
        name=f"probe_column_sums_bq{block_q}_bk{block_k}",
    )(q, lse, prefix_k, lens)
    return scores[:, :m]


# ----------------------------------------------------------------------------- reference


@functools.partial(jax.jit, static_argnames=("kv_head_of_probe", "scale", "with_logits"))
def probe_scores_reference(q, prefix_k, own_k, *, kv_head_of_probe, prefix_len=None,
                           q_len=None, scale=None, with_logits=False):
    """Plain jnp: materialises the full [P, n_q, m + n_q] softmax. For tests and CPU. With `with_logits`, returns
    (scores, logits): the logits too, f32 [P, n_q, m + n_q] over the prefix keys and then the computed ones,
    unmasked and not yet scaled (the products the scoring made anyway, so keeping them writes nothing more; what
    `gathered_attention.attention_over_logits` weighs a selection's values by).

    Probe heads that come in equal runs per KV head (every query head of a grouped-query model, or a few probes of
    one KV head) score as one product per KV head, its query heads' rows stacked: no KV head's keys are copied per
    query head (less time on a CPU, the same scores bit for bit: `benchmarks/results/cpu/selective-takes`)."""
    num_probes, n_q, head_dim = q.shape
    m = prefix_k.shape[1]
    scale = c.default_scale(head_dim, scale)
    prefix_len, q_len = c.length_or_full(prefix_len, m), c.length_or_full(q_len, n_q)
    heads = np.asarray(kv_head_of_probe)
    groups = _equal_runs(heads)
    if groups is None:  # each probe head against its own copy of its KV head's keys
        keys = jnp.concatenate([prefix_k[heads], own_k[heads]], axis=1).astype(jnp.float32)
        products = jnp.einsum("pqd,pkd->pqk", q.astype(jnp.float32), keys, precision=lax.Precision.HIGHEST)
    else:
        keys = jnp.concatenate([prefix_k[groups], own_k[groups]], axis=1).astype(jnp.float32)
        stacked = q.astype(jnp.float32).reshape(len(groups), -1, head_dim)  # [G, heads of G x n_q, d]
        products = jnp.einsum("gqd,gkd->gqk", stacked, keys,
                              precision=lax.Precision.HIGHEST).reshape(num_probes, n_q, -1)
    scores = products * scale
    rows = jnp.arange(n_q)
    prefix_valid = (jnp.arange(m) < prefix_len)[None, :] & (rows < q_len)[:, None]
    valid = jnp.concatenate([prefix_valid, c.causal_valid(rows, rows, q_len)], axis=1)
    weights = jax.nn.softmax(jnp.where(valid, scores, c.MASK_VALUE), axis=-1)
    weights = jnp.where(valid, weights, 0.0)
    importance = weights[:, :, :m].sum(axis=1)
    return (importance, products) if with_logits else importance


def _equal_runs(heads: np.ndarray) -> np.ndarray | None:
    """The KV heads of `heads` (each probe's) when the probes come in runs of one length, one run per distinct KV
    head (e.g. 0,0,1,1 or 2,2,2), else None."""
    starts = np.flatnonzero(np.r_[True, heads[1:] != heads[:-1]])
    runs = heads[starts]
    if len(np.unique(runs)) != len(runs) or len(heads) % len(runs):
        return None
    return runs if (np.repeat(runs, len(heads) // len(runs)) == heads).all() else None


# ----------------------------------------------------------------------------- public


def probe_scores(q, prefix_k, own_k, *, kv_head_of_probe: Sequence[int], prefix_len=None,
                 q_len=None, scale: float | None = None, impl: str = "auto",
                 block_q: int | None = None, block_k: int | None = None,
                 k_splits: int | None = None, with_logits: bool = False):
    """H2O importance of each prefix token for each probe head, f32[P, m].

    Args:
      q: [P, n_q, d] unscaled queries of the probe heads for the computed tokens.
      prefix_k: [P_kv, m, d] prefix keys (already position-encoded) of the KV heads used.
      own_k: [P_kv, n_q, d] keys of the computed tokens, which come after the prefix.
      kv_head_of_probe: static; probe head p reads prefix_k[kv_head_of_probe[p]].
      prefix_len: valid prefix columns (may be traced); columns past it score 0.
      q_len: valid query rows (may be traced); rows past it add nothing.
      scale: softmax scale, default d ** -0.5.
      impl: "auto" (Pallas on GPU, reference elsewhere), "pallas" or "reference".
      block_q, block_k, k_splits: Pallas tiling (powers of two; None picks defaults).
      with_logits: return (importance, logits), the logits f32 [P, n_q, m + n_q] as probe_scores_reference gives
        them where the reference runs, None where Pallas does (it never holds them).

    importance[p, j] = sum over valid rows i of softmax_i(j), the softmax of row i running
    over the valid prefix keys and the computed keys 0..i; fp32 accumulation.
    """
    kv_head_of_probe = _check_probe_args(q, prefix_k, own_k, kv_head_of_probe)
    num_probes, n_q, head_dim = q.shape
    m = prefix_k.shape[1]
    c.check_length("prefix_len", prefix_len, m)
    c.check_length("q_len", q_len, n_q)
    if m == 0 or n_q == 0:
        empty = jnp.zeros((num_probes, m), jnp.float32)
        return (empty, None) if with_logits else empty
    dispatch = c.resolve_impl(impl)
    scale = c.default_scale(head_dim, scale)
    if not dispatch.use_pallas:
        return probe_scores_reference(q, prefix_k, own_k, kv_head_of_probe=kv_head_of_probe,
                                      prefix_len=prefix_len, q_len=q_len, scale=scale, with_logits=with_logits)
    interpret = dispatch.interpret
    block_q, block_k, k_splits = c.pallas_tiling(n_q, m, num_probes, head_dim, block_q, block_k, k_splits,
                                                 interpret=interpret)
    importance = probe_scores_pallas(
        q, prefix_k, own_k, c.length_or_full(prefix_len, m), c.length_or_full(q_len, n_q),
        kv_head_of_probe=kv_head_of_probe, scale=scale, block_q=block_q, block_k=block_k,
        k_splits=k_splits, interpret=interpret)
    return (importance, None) if with_logits else importance


def _check_probe_args(q, prefix_k, own_k, kv_head_of_probe) -> tuple[int, ...]:
    c.check_rank("q", q, 3, "[P, n_q, d]")
    c.check_rank("prefix_k", prefix_k, 3, "[P_kv, m, d]")
    c.check_rank("own_k", own_k, 3, "[P_kv, n_q, d]")
    num_probes, n_q, head_dim = q.shape
    num_kv = prefix_k.shape[0]
    if prefix_k.shape[2] != head_dim or own_k.shape != (num_kv, n_q, head_dim):
        raise ValueError(
            f"shapes disagree: q {q.shape}, prefix_k {prefix_k.shape}, own_k {own_k.shape}; "
            "want q [P, n_q, d], prefix_k [P_kv, m, d], own_k [P_kv, n_q, d].")
    heads = tuple(int(h) for h in kv_head_of_probe)
    if len(heads) != num_probes or any(not 0 <= h < num_kv for h in heads):
        raise ValueError(
            f"kv_head_of_probe={heads} must give, for each of the {num_probes} probe heads, "
            f"an index into the {num_kv} KV heads of prefix_k.")
    return heads
