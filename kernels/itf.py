"""SPEC's similarity-guided identification (ITF, docs/systems.md) on probe-head scores: per-head top-k sets, their
mean pairwise Jaccard, the threshold, and the shared set. The one implementation of ITF's decision."""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.kernels.common import length_or_full


def top_k(scores: jax.Array, k_cap: int, prefix_len=None) -> jax.Array:
    """Per row, the indices of the k_cap highest scores among the first `prefix_len` columns, best first
    (int32 [..., k_cap]). Columns at or past `prefix_len` (padding) come only after every valid one."""
    valid = _valid_columns(scores, prefix_len)
    _, idx = lax.top_k(jnp.where(valid, scores, -jnp.inf), k_cap)
    return idx.astype(jnp.int32)


def top_k_mask(scores: jax.Array, k, prefix_len=None) -> jax.Array:
    """Per row, the columns of its k highest scores among the first `prefix_len` as a mask (bool, scores' shape):
    the first k columns `top_k` gives (ties: the lower column), found without sorting. k may be traced.

    The k-th highest score of a row is found bit by bit on the scores' order-preserving integer keys (32 passes that
    compare and count); the row keeps every column above it and, of those equal to it, the first few. With no sort
    it takes a fraction of `lax.top_k`'s time on a CPU, with the columns listed (`set_columns`) too
    (`benchmarks/results/cpu/selection-masks`)."""
    valid = _valid_columns(scores, prefix_len)
    keys = _order_keys(jnp.where(valid, scores, -jnp.inf).astype(jnp.float32))
    k = jnp.asarray(k, jnp.int32)

    def bit(i, kth):  # the highest key with at least k keys of the row at or above it, one bit at a time
        trial = kth | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where((keys >= trial[..., None]).sum(-1) >= k, trial, kth)

    kth = lax.fori_loop(0, 32, bit, jnp.zeros(scores.shape[:-1], jnp.uint32))[..., None]
    above, tie = keys > kth, keys == kth
    return above | (tie & (jnp.cumsum(tie, -1) <= k - above.sum(-1, keepdims=True)))


def set_columns(mask: jax.Array, size: int) -> jax.Array:
    """Per row of a mask [..., m], its set columns in ascending order, int32 [..., size], 0 after them (a set of
    `top_k_mask` as indices for a gather, which reads them in order)."""
    rows = mask.reshape(-1, mask.shape[-1])
    cols = jax.vmap(lambda row: jnp.nonzero(row, size=size, fill_value=0)[0])(rows)
    return cols.astype(jnp.int32).reshape(mask.shape[:-1] + (size,))


def _valid_columns(scores: jax.Array, prefix_len) -> jax.Array:
    """bool [m]: the columns of scores [..., m] before `prefix_len` (None: all)."""
    return jnp.arange(scores.shape[-1]) < length_or_full(prefix_len, scores.shape[-1])


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys of f32 values in the same order (-inf lowest), for comparing and counting on integers."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def normalised(scores: jax.Array, prefix_len=None) -> jax.Array:
    """Each row's scores over the valid prefix divided by their sum (zeros past it): every head one vote."""
    valid = _valid_columns(scores, prefix_len)
    masked = jnp.where(valid, scores, 0.0)
    return masked / jnp.maximum(masked.sum(-1, keepdims=True), jnp.finfo(jnp.float32).tiny)


class Identification(NamedTuple):
    """One layer's ITF decision (all jax arrays)."""

    shared: jax.Array  # int32 [k_cap]: top-k of the probes' summed normalised scores, best first
    probe_sets: jax.Array  # bool [P, m_pad]: each probe's own top-k (`top_k_mask`)
    jaccard: jax.Array  # the probes' mean pairwise Jaccard of their top-k sets
    threshold: jax.Array  # t = j ** alpha
    use_shared: jax.Array  # jaccard >= threshold: every head takes `shared`


@functools.partial(jax.jit, static_argnames=("k_cap",))
def identify(probe_scores: jax.Array, k, prefix_len, alpha, *, k_cap: int) -> Identification:
    """SPEC's similarity-guided identification (ITF, docs/systems.md) of one layer from its probe heads' H2O scores
    f32 [P, m_pad]: the first `k` of each k_cap-long set are valid. The engine (`engine.state.itf_select`) and the
    observations (`eval.observe`) both decide with this function."""
    probe_sets = top_k_mask(probe_scores, k, prefix_len)
    jaccard = mean_pairwise_jaccard_of_masks(probe_sets)
    threshold = itf_threshold(k, prefix_len, alpha)
    shared = top_k(normalised(probe_scores, prefix_len).sum(0), k_cap, prefix_len)
    return Identification(shared, probe_sets, jaccard, threshold, jaccard >= threshold)


@functools.partial(jax.jit, static_argnames=("k_cap",))
def head_share(head_scores: jax.Array, shared: jax.Array, k, prefix_len=None, *, k_cap: int,
               own_sets: jax.Array | None = None) -> jax.Array:
    """The least share, over heads, of a head's own top-k attention that a shared set keeps: for every row of
    head_scores f32 [H, m_pad] (H2O importance over the first `prefix_len` columns), the scores summed over the
    first `k` entries of `shared` int32 [k_cap] divided by the sum of that row's own k highest; the minimum over
    rows. 1.0 when the shared set is every head's own top-k; how much a head loses by sharing, the worst head.
    spec_gqa's guard (`engine.identify.GroupedITF`): heads that share keys agree by Jaccard without agreeing head
    by head. `own_sets`: every head's own top-k as a mask bool [H, m_pad] (`top_k_mask`), when the caller has it."""
    valid = _valid_columns(head_scores, prefix_len)
    scores = jnp.where(valid, head_scores, 0.0)
    own_sets = top_k_mask(head_scores, k, prefix_len) if own_sets is None else own_sets
    own = jnp.where(own_sets, scores, 0.0).sum(-1)
    kept = jnp.where(jnp.arange(k_cap) < k, scores[:, shared], 0.0).sum(-1)
    return jnp.min(jnp.where(own > 0, kept / jnp.maximum(own, jnp.finfo(jnp.float32).tiny), 1.0))


@jax.jit
def mean_pairwise_jaccard(idx: jax.Array, count=None) -> jax.Array:
    """Mean over head pairs of |A & B| / |A | B| for the index sets idx[P, k] (rows are sets).

    Only the first `count` entries of each row count (None: all). One head, or empty sets,
    give 1.0: nothing disagrees.
    """
    num_heads, k = idx.shape
    if num_heads < 2:
        return jnp.float32(1.0)
    count = length_or_full(count, k)
    position = jnp.arange(k)
    # Padding entries become distinct negatives, so they match nothing, in any row.
    sentinels = -1 - position[None, :] - k * jnp.arange(num_heads)[:, None]
    keyed = jnp.where(position[None, :] < count, idx, sentinels)
    first, second = (np.asarray(side) for side in
                     zip(*itertools.combinations(range(num_heads), 2)))
    # An element in both sets appears twice in the merged, sorted pair.
    merged = jnp.sort(jnp.concatenate([keyed[first], keyed[second]], axis=1), axis=1)
    intersection = jnp.sum(merged[:, 1:] == merged[:, :-1], axis=1)
    return _mean_jaccard(intersection, 2 * count - intersection)


@jax.jit
def mean_pairwise_jaccard_of_masks(sets: jax.Array) -> jax.Array:
    """`mean_pairwise_jaccard` of sets given as masks bool [P, m] (rows are sets), with no sort: the same value
    for the same sets."""
    num_heads = sets.shape[0]
    if num_heads < 2:
        return jnp.float32(1.0)
    first, second = (np.asarray(side) for side in zip(*itertools.combinations(range(num_heads), 2)))
    sizes = sets.sum(-1, dtype=jnp.int32)
    intersection = (sets[first] & sets[second]).sum(-1, dtype=jnp.int32)
    return _mean_jaccard(intersection, sizes[first] + sizes[second] - intersection)


def _mean_jaccard(intersection: jax.Array, union: jax.Array) -> jax.Array:
    """The mean over pairs of |A & B| / |A | B| from their integer sizes; a pair of empty sets agrees (1.0)."""
    jaccard = jnp.where(union > 0, intersection / jnp.maximum(union, 1), 1.0)
    return jaccard.mean().astype(jnp.float32)


@jax.jit
def itf_threshold(k, n, alpha=0.6) -> jax.Array:
    """SPEC's similarity threshold t = j ** alpha for k of n tokens kept.

    j = (k^2/n) / (2k - k^2/n) is the expected Jaccard of two random k-subsets of n.
    """
    k, n = jnp.asarray(k, jnp.float32), jnp.asarray(n, jnp.float32)
    overlap = k * k / jnp.maximum(n, 1.0)
    expected = jnp.where(k > 0, overlap / jnp.maximum(2 * k - overlap, 1e-30), 0.0)
    return expected ** alpha
