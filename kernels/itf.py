"""SPEC's similarity-guided identification (ITF, design 4.2) on probe-head scores:
per-head top-k sets, their mean pairwise Jaccard, the threshold, and the shared set."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.kernels._common import length_or_full


@functools.partial(jax.jit, static_argnames=("k",))
def topk_per_head(scores: jax.Array, k: int, prefix_len=None) -> jax.Array:
    """Per head, the k highest-scoring prefix tokens as int32[P, k], sorted by position.

    Columns at or past `prefix_len` (padding) are never chosen unless k exceeds it.
    """
    return _topk_sorted(_mask_padding(scores, prefix_len), k)


@functools.partial(jax.jit, static_argnames=("k",))
def shared_topk(scores: jax.Array, k: int, prefix_len=None) -> jax.Array:
    """One index set for all heads: int32[k], sorted by position.

    Each head's scores are first divided by their sum over the valid prefix (so every probe
    head has one vote of equal weight), then summed over heads; the top-k of that sum wins.
    """
    scores = _mask_padding(scores, prefix_len, fill=0.0)
    total = scores.sum(axis=1, keepdims=True)
    normalised = scores / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)
    summed = _mask_padding(normalised.sum(axis=0, keepdims=True), prefix_len)
    return _topk_sorted(summed, k)[0]


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
    union = 2 * count - intersection
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


@jax.jit
def use_shared_selection(mean_jaccard, k, n, alpha=0.6) -> jax.Array:
    """True when the probe heads agree enough (J >= t) to share one index set this layer."""
    return mean_jaccard >= itf_threshold(k, n, alpha)


def _mask_padding(scores, prefix_len, fill=-jnp.inf):
    valid = jnp.arange(scores.shape[1]) < length_or_full(prefix_len, scores.shape[1])
    return jnp.where(valid[None, :], scores, fill)


def _topk_sorted(scores, k):
    if not 0 <= k <= scores.shape[1]:
        raise ValueError(f"k={k} must be in [0, {scores.shape[1]}] (the prefix length).")
    _, idx = lax.top_k(scores, k)
    return jnp.sort(idx, axis=1).astype(jnp.int32)
