"""Quest's chunk bounds: how much attention each stored chunk could take, from its key summaries alone.

For a query q and a chunk whose keys lie element-wise in [mn, mx], every key's score is at most
sum_d max(q_d mn_d, q_d mx_d) (Quest, Tang et al. 2024). `chunk_mass` turns those bounds into a mass per chunk and
query head, as H2O turns scores into importance: a softmax over the chunks for each query token, summed over the
query tokens and normalised, so every head has one vote. Plain jnp (a [H, n, C] product, small next to attention).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.kernels import common as c


@functools.partial(jax.jit, static_argnames=("kv_of_head", "scale"))
def chunk_bounds(q, summaries, *, kv_of_head, scale=None):
    """Upper bounds f32 [H, n, C] of scale * q.k over each chunk's keys. q: [H, n, d] queries (position-encoded,
    unscaled); summaries: [C, G, 2, d] each chunk's (min, max) keys per KV head; kv_of_head: static, the KV head of
    each query head."""
    heads = np.asarray(kv_of_head)
    s = summaries[:, heads].astype(jnp.float32)  # [C, H, 2, d]
    qf = q.astype(jnp.float32)
    hi = jnp.einsum("hnd,chd->hnc", jnp.maximum(qf, 0.0), s[:, :, 1], precision=lax.Precision.HIGHEST)
    lo = jnp.einsum("hnd,chd->hnc", jnp.minimum(qf, 0.0), s[:, :, 0], precision=lax.Precision.HIGHEST)
    return (hi + lo) * c.default_scale(q.shape[-1], scale)


@functools.partial(jax.jit, static_argnames=("kv_of_head", "scale"))
def chunk_mass(q, summaries, q_len, n_chunks, *, kv_of_head, scale=None):
    """Bounded attention mass f32 [H, C] of each chunk for each query head: per valid query token (the first
    `q_len`), a softmax of `chunk_bounds` over the valid chunks (the first `n_chunks`), summed and normalised to 1
    per head; zeros past `n_chunks`."""
    bounds = chunk_bounds(q, summaries, kv_of_head=kv_of_head, scale=scale)
    valid = (jnp.arange(bounds.shape[1]) < q_len)[:, None] & (jnp.arange(bounds.shape[2]) < n_chunks)[None, :]
    weights = jnp.where(valid[None], jax.nn.softmax(jnp.where(valid[None], bounds, c.MASK_VALUE), axis=-1), 0.0)
    mass = weights.sum(axis=1)
    return mass / jnp.maximum(mass.sum(-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
