"""The importance state carried across layers, and the pure steps that choose which prefix tokens a layer keeps.

Everything here is jitted and side-effect free: a step takes the state and scores and returns a new state plus
the chosen indices. The host reads the indices back only to move bytes.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp

from specjax.kernels import itf


@chex.dataclass
class ImportanceState:
    """Per-layer record of a request's selections, `[L, ...]` arrays updated layer by layer.

    selected / count: the token set the layer used when all heads share one (ITF), else the union of the
        per-head sets; -1 pads. jaccard / threshold: probe heads' mean pairwise Jaccard and SPEC's t = j^alpha
        (NaN where not measured). head_share: the least share of a head's own top-k attention the shared set
        keeps (spec_gqa on grouped-query models; NaN where not measured). fallback: the layer loaded all keys and
        used per-head sets. retained: kept fraction of the reused prefix. period_importance: [capacity] each
        prefix token's importance as the current ContiguousKV period's first layer scored it (`chunk_select`),
        which the period's later layers weigh their chunks by (zeros until a period chooses).
    """

    selected: jax.Array
    count: jax.Array
    jaccard: jax.Array
    threshold: jax.Array
    head_share: jax.Array
    fallback: jax.Array
    retained: jax.Array
    period_importance: jax.Array

    @classmethod
    def init(cls, num_layers: int, capacity: int) -> "ImportanceState":
        nan = jnp.full((num_layers,), jnp.nan, jnp.float32)
        return cls(
            selected=jnp.full((num_layers, capacity), -1, jnp.int32),
            count=jnp.zeros((num_layers,), jnp.int32),
            jaccard=nan,
            threshold=nan,
            head_share=nan,
            fallback=jnp.zeros((num_layers,), bool),
            retained=nan,
            period_importance=jnp.zeros((capacity,), jnp.float32),
        )


def _row(state_row, idx, count):
    """A state row [capacity] holding the first `count` entries of idx, -1 elsewhere."""
    padded = jnp.where(jnp.arange(idx.shape[-1]) < count, idx, -1)
    return jnp.full_like(state_row, -1).at[: idx.shape[-1]].set(padded)


@functools.partial(jax.jit, static_argnames=("k_cap",))
def itf_select(state: ImportanceState, layer, probe_scores, k, prefix_len, alpha, *, k_cap: int, kept_of=None):
    """SPEC's similarity-guided identification for one layer (docs/systems.md).

    probe_scores: f32 [P, m_pad] H2O importance from the probe heads. Returns (state, shared int32[k_cap],
    use_shared bool): the top-k of the probe heads' summed normalised scores (first `k` entries valid, best
    first) and whether the probe heads' mean pairwise Jaccard reaches t = j ** alpha. `kept_of`: the prefix length
    the retained fraction is of, when the scores cover only part of it (default `prefix_len`).
    """
    decision = itf.identify(probe_scores, k, prefix_len, alpha, k_cap=k_cap)
    return _record_itf(state, layer, decision, k, prefix_len, kept_of), decision.shared, decision.use_shared


def _record_itf(state: ImportanceState, layer, decision: itf.Identification, k, prefix_len, kept_of):
    return state.replace(
        selected=state.selected.at[layer].set(_row(state.selected[layer], decision.shared, k)),
        count=state.count.at[layer].set(k),
        jaccard=state.jaccard.at[layer].set(decision.jaccard),
        threshold=state.threshold.at[layer].set(decision.threshold),
        fallback=state.fallback.at[layer].set(~decision.use_shared),
        retained=state.retained.at[layer].set(k / jnp.maximum(prefix_len if kept_of is None else kept_of, 1)),
    )


@functools.partial(jax.jit, static_argnames=("k_cap",))
def guard_shared(state: ImportanceState, layer, head_scores, shared, k, prefix_len, use_shared, min_share, *,
                 k_cap: int):
    """spec_gqa's guard on a shared set (`itf_select`'s): every query head's scores f32 [H, m_pad] must keep at
    least `min_share` of their own top-k's attention under it (`kernels.itf.head_share`, recorded). Returns
    (state, use_shared and the guard holds)."""
    return _guard(state, layer, head_scores, shared, k, prefix_len, use_shared, min_share, k_cap, None)


def _guard(state: ImportanceState, layer, head_scores, shared, k, prefix_len, use_shared, min_share, k_cap, own_sets):
    share = itf.head_share(head_scores, shared, k, prefix_len, k_cap=k_cap, own_sets=own_sets)
    use_shared = use_shared & (share >= min_share)
    return state.replace(head_share=state.head_share.at[layer].set(share),
                         fallback=state.fallback.at[layer].set(~use_shared)), use_shared


@functools.partial(jax.jit, static_argnames=("groups", "probe_rows", "k_cap", "guarded"))
def gqa_select(state: ImportanceState, layer, head_scores, k, prefix_len, alpha, min_share, *, groups: int,
               probe_rows: int, k_cap: int, guarded: bool, kept_of=None):
    """spec_gqa's whole decision for one layer, in one step, from every query head's H2O scores f32 [H, m_pad] (rows
    grouped by KV head; the first `probe_rows` are the `groups` probe KV heads' query heads): the probes' scores
    (`kv_head_scores`), ITF's test on them (`itf_select`), with `guarded` its guard (`guard_shared`, threshold
    `min_share`), and every head's own top-k, which the guard weighs the shared set against and which the layer
    keeps if it falls back (`per_head_select`'s). The same state and sets as those steps one after the other.

    Returns (state, probes f32 [groups, m_pad], shared int32 [k_cap], per_head int32 [H, k_cap], use_shared);
    every head's own set is listed only on a layer that falls back (zeros otherwise)."""
    probes = kv_head_scores(head_scores[:probe_rows], prefix_len, groups=groups)
    own_sets = itf.top_k_mask(head_scores, k, prefix_len) if guarded else None
    decision = itf.identify(probes, k, prefix_len, alpha, k_cap=k_cap)
    state = _record_itf(state, layer, decision, k, prefix_len, kept_of)
    use_shared = decision.use_shared
    if guarded:
        state, use_shared = _guard(state, layer, head_scores, decision.shared, k, prefix_len, use_shared, min_share,
                                   k_cap, own_sets)

    def listed(scores):
        return itf.set_columns(itf.top_k_mask(scores, k, prefix_len) if own_sets is None else own_sets, k_cap)

    per_head = jax.lax.cond(use_shared, lambda scores: jnp.zeros(scores.shape[:-1] + (k_cap,), jnp.int32), listed,
                            head_scores)
    return state, probes, decision.shared, per_head, use_shared


@functools.partial(jax.jit, static_argnames=("k_cap",))
def per_head_select(state: ImportanceState, layer, head_scores, k, prefix_len, *, k_cap: int, kept_of=None):
    """H2O per head (AS+H2O, and ITF's fallback): the top-k of every head's own scores [H, m_pad] -> int32
    [H, k_cap], each head's set in ascending positions (`kernels.itf.top_k_mask`), zeros after the k-th.
    `kept_of`: as in `itf_select`."""
    idx = itf.set_columns(itf.top_k_mask(head_scores, k, prefix_len), k_cap)
    state = state.replace(
        fallback=state.fallback.at[layer].set(True),
        retained=state.retained.at[layer].set(k / jnp.maximum(prefix_len if kept_of is None else kept_of, 1)),
    )
    return state, idx


@functools.partial(jax.jit, static_argnames=("groups",))
def kv_head_scores(scores, prefix_len, *, groups: int):
    """Per KV head, its query heads' H2O scores f32 [groups * q_per_kv, m_pad] (rows grouped by KV head, in order)
    normalised over the valid prefix and summed, every query head one vote -> [groups, m_pad]. With one query head
    per KV head, the scores as they are (what ITF's probes score)."""
    if scores.shape[0] == groups:
        return scores
    return itf.normalised(scores, prefix_len).reshape(groups, -1, scores.shape[-1]).sum(1)


@jax.jit
def record_union(state: ImportanceState, layer, union, count):
    """Record the token set a per-head layer loaded values for (the union of its heads' sets)."""
    return state.replace(selected=state.selected.at[layer].set(_row(state.selected[layer], union, count)),
                         count=state.count.at[layer].set(count))


@functools.partial(jax.jit, static_argnames=("chunk_tokens", "chunk_cap", "k_cap"))
def chunk_select(state: ImportanceState, layer, head_scores, n_chunks, prefix_len, *, chunk_tokens: int,
                 chunk_cap: int, k_cap: int):
    """ContiguousKV's identification at a period's first layer (docs/systems.md): whole chunks of `chunk_tokens`.

    head_scores: f32 [H, m_pad] H2O importance of every head. A token's importance is its share of each head's
    attention averaged over heads; a chunk's score is the sum over its tokens (ContiguousKV eq. 1). The
    `n_chunks` (<= chunk_cap) best chunks are kept. Returns (state, positions int32[k_cap] ascending, the first
    `count` valid, count, importance f32 [m_pad] of each token for the cache score, kept as the state's
    `period_importance` for the period's later layers); k_cap must hold them.
    """
    c = chunk_tokens
    valid = jnp.arange(head_scores.shape[-1]) < prefix_len
    masked = jnp.where(valid, head_scores, 0.0)
    importance = (masked / jnp.maximum(masked.sum(-1, keepdims=True), jnp.finfo(jnp.float32).tiny)).mean(0)
    chunk_scores = jnp.pad(importance, (0, -importance.shape[0] % c)).reshape(-1, c).sum(-1)
    stored_chunks = (prefix_len + c - 1) // c
    ranked = min(chunk_cap, chunk_scores.shape[0])
    _, best = jax.lax.top_k(
        jnp.where(jnp.arange(chunk_scores.shape[0]) < stored_chunks, chunk_scores, -jnp.inf), ranked)
    tokens = (best[:, None] * c + jnp.arange(c)[None, :]).reshape(-1)
    keep = (jnp.repeat(jnp.arange(ranked), c) < n_chunks) & (tokens < prefix_len)
    big = jnp.iinfo(jnp.int32).max
    positions = jnp.sort(jnp.where(keep, tokens, big)).astype(jnp.int32)[:k_cap]
    positions = jnp.pad(positions, (0, k_cap - positions.shape[0]), constant_values=big)
    count = keep.sum().astype(jnp.int32)
    state = state.replace(
        selected=state.selected.at[layer].set(_row(state.selected[layer], positions, count)),
        count=state.count.at[layer].set(count),
        retained=state.retained.at[layer].set(count / jnp.maximum(prefix_len, 1)),
        period_importance=jnp.zeros_like(state.period_importance).at[: importance.shape[0]].set(importance),
    )
    return state, positions, count, importance


@jax.jit
def reuse_selection(state: ImportanceState, layer, source_layer):
    """A later layer of a period keeps the chunk set its first layer chose (ContiguousKV periods)."""
    return state.replace(selected=state.selected.at[layer].set(state.selected[source_layer]),
                         count=state.count.at[layer].set(state.count[source_layer]),
                         retained=state.retained.at[layer].set(state.retained[source_layer]))
