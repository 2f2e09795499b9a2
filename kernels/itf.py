"""SPEC's similarity-guided identification (ITF, design 4.2) on probe-head scores: per-head top-k sets, their
mean pairwise Jaccard, the threshold, and the shared set. The one implementation of ITF's decision."""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.kernels._common import length_or_full


def top_k(scores: jax.Array, k_cap: int, prefix_len=None) -> jax.Array:
    """Per row, the indices of the k_cap highest scores among the first `prefix_len` columns, best first
    (int32 [..., k_cap]). Columns at or past `prefix_len` (padding) come only after every valid one."""
    valid = jnp.arange(scores.shape[-1]) < length_or_full(prefix_len, scores.shape[-1])
    _, idx = lax.top_k(jnp.where(valid, scores, -jnp.inf), k_cap)
    return idx.astype(jnp.int32)


def normalised(scores: jax.Array, prefix_len=None) -> jax.Array:
    """Each row's scores over the valid prefix divided by their sum (zeros past it): every head one vote."""
    valid = jnp.arange(scores.shape[-1]) < length_or_full(prefix_len, scores.shape[-1])
    masked = jnp.where(valid, scores, 0.0)
    return masked / jnp.maximum(masked.sum(-1, keepdims=True), jnp.finfo(jnp.float32).tiny)


class Identification(NamedTuple):
    """One layer's ITF decision (all jax arrays)."""

    shared: jax.Array  # int32 [k_cap]: top-k of the probes' summed normalised scores, best first
    per_probe: jax.Array  # int32 [P, k_cap]: each probe's own top-k, best first
    jaccard: jax.Array  # the probes' mean pairwise Jaccard over their first k entries
    threshold: jax.Array  # t = j ** alpha
    use_shared: jax.Array  # jaccard >= threshold: every head takes `shared`


@functools.partial(jax.jit, static_argnames=("k_cap",))
def identify(probe_scores: jax.Array, k, prefix_len, alpha, *, k_cap: int) -> Identification:
    """SPEC's similarity-guided identification (ITF, design 4.2) of one layer from its probe heads' H2O scores
    f32 [P, m_pad]: the first `k` of each k_cap-long set are valid. The engine (`engine.state.itf_select`) and the
    observations (`eval.observe`) both decide with this function."""
    per_probe = top_k(probe_scores, k_cap, prefix_len)
    jaccard = mean_pairwise_jaccard(per_probe, count=k)
    threshold = itf_threshold(k, prefix_len, alpha)
    shared = top_k(normalised(probe_scores, prefix_len).sum(0), k_cap, prefix_len)
    return Identification(shared, per_probe, jaccard, threshold, jaccard >= threshold)


@functools.partial(jax.jit, static_argnames=("k_cap",))
def head_share(head_scores: jax.Array, shared: jax.Array, k, prefix_len=None, *, k_cap: int,
               own_top: jax.Array | None = None) -> jax.Array:
    """The least share, over heads, of a head's own top-k attention that a shared set keeps: for every row of
    head_scores f32 [H, m_pad] (H2O importance over the first `prefix_len` columns), the scores summed over the
    first `k` entries of `shared` int32 [k_cap] divided by the sum of that row's own k highest; the minimum over
    rows. 1.0 when the shared set is every head's own top-k; how much a head loses by sharing, the worst head.
    spec_gqa's guard (`engine.identify.GroupedITF`): heads that share keys agree by Jaccard without agreeing head
    by head. `own_top`: every head's own top-k int32 [H, k_cap] (`top_k`), when the caller has it already."""
    valid = jnp.arange(head_scores.shape[-1]) < length_or_full(prefix_len, head_scores.shape[-1])
    scores = jnp.where(valid, head_scores, 0.0)
    first = jnp.arange(k_cap) < k
    own_top = top_k(head_scores, k_cap, prefix_len) if own_top is None else own_top
    own = jnp.where(first, jnp.take_along_axis(scores, own_top, -1), 0.0).sum(-1)
    kept = jnp.where(first, scores[:, shared], 0.0).sum(-1)
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
