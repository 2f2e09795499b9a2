"""How a layer chooses which reused prefix tokens it keeps, and therefore what it must read: one policy per
identification a `System` names (`System.identify`).

Each policy declares `certain_reads`, the store kinds a layer reads whatever it then selects (what `certain`
prefetch reads one layer ahead), `selection_reads(engine)`, the kinds it reads for the tokens it selects (what
speculation reads ahead), and `select`, which reads through the request's `LayerIO`, updates the
`ImportanceState` and returns the layer's prefix KV with its selection:

    (state, prefix_k, prefix_v, selection, importance of R [m], chosen positions of R [1 or H, k])

`policy(name)` refuses an unknown identification, so a `System` naming one fails when it is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from specjax.engine import state as st
from specjax.engine import steps as S
from specjax.errors import SpecjaxError
from specjax.kernels import PerHeadIndices, SharedIndices
from specjax.models.inference import bucket, padded
from specjax.stores import K, PROBE, V

if TYPE_CHECKING:
    from specjax.engine.engine import Engine
    from specjax.engine.layer_io import LayerIO


def _every_head_scores(engine: Engine, io: LayerIO, q, keys, own_k, n):
    """H2O importance [H, m_pad] of the prefix for every query head, from all of the layer's keys (timed)."""
    return io.clock.timed("identify", S.scores, q, keys, own_k, io.m, n, kv_head_of_probe=engine.kv_of_head,
                          impl=engine.config.kernel_impl)


class LoadAll:
    """No identification: every prefix token's K and V (AttentionStore, and CacheBlend's full reuse)."""

    certain_reads = (K, V)

    def selection_reads(self, engine: Engine) -> tuple:
        return ()

    def select(self, engine: Engine, io: LayerIO, state, layer, q, own_k, n, k, k_cap):
        m, m_pad = io.m, io.m_pad
        keys, values = io.take_all(layer, K), io.take_all(layer, V)
        state = st.record_union(state, layer, jnp.arange(m_pad, dtype=jnp.int32), m)
        selection = SharedIndices(jnp.arange(m_pad, dtype=jnp.int32), m)
        return state, keys, values, selection, np.ones(m, np.float32), np.arange(m)[None]


class H2O:
    """Per-head H2O (AS+H2O): every head's scores from all keys, then the values of each head's top-k."""

    certain_reads = (K,)

    def selection_reads(self, engine: Engine) -> tuple:
        return (V,)

    def select(self, engine: Engine, io: LayerIO, state, layer, q, own_k, n, k, k_cap, keys=None):
        """`keys`: the layer's K [kv_heads, m_pad, d] when the caller holds them already (else they are read)."""
        m, m_pad = io.m, io.m_pad
        keys = io.take_all(layer, K) if keys is None else keys
        scores = _every_head_scores(engine, io, q, keys, own_k, n)
        state, per_head = io.clock.timed("identify", st.per_head_select, state, layer, scores, k, m, k_cap=k_cap)
        chosen = np.asarray(per_head)[:, :k]
        union = np.unique(chosen)
        state = st.record_union(state, layer, jnp.asarray(padded(union, m_pad, -1)), len(union))
        union_pad = bucket(len(union))
        values = S.scatter_tokens(keys, jnp.asarray(padded(union, union_pad, m_pad)),
                                  io.take(layer, V, union, union_pad))
        return state, keys, values, PerHeadIndices(per_head, k), S.normalised_importance(scores, m), chosen


class ITF(H2O):
    """SPEC's similarity-guided identification (design 4.2): the probe heads' keys score the prefix; if the probe
    heads agree (mean pairwise Jaccard >= t = j ** alpha) every head takes their shared top-k and only its K/V
    are read; otherwise the layer falls back to per-head H2O.

    When the probe keys are every KV head's (`Engine.probe_is_k`: probe heads spread over all KV heads, as
    tiny-llama's 3 over its 2; not smollm2, whose 3 probe heads share one of its 3 KV heads), they are the layer's
    K: the shared set's keys are gathered from them, and only its V read."""

    certain_reads = (PROBE,)

    def selection_reads(self, engine: Engine) -> tuple:
        return (V,) if engine.probe_is_k else (K, V)

    def select(self, engine: Engine, io: LayerIO, state, layer, q, own_k, n, k, k_cap):
        m = io.m
        probe_k = io.take_all(layer, PROBE, phase="probe_io")
        scores = io.clock.timed("identify", S.scores, q, probe_k, own_k, m, n, kv_head_of_probe=engine.kv_of_probe,
                                impl=engine.config.kernel_impl, q_heads=tuple(map(int, engine.probe_q)),
                                kv_heads=tuple(map(int, engine.probe_kv)))
        state, shared, use_shared = io.clock.timed(
            "identify", st.itf_select, state, layer, scores, k, m, engine.system.alpha, k_cap=k_cap)
        if not bool(use_shared):  # all keys: the probe keys already are, when they are every KV head's
            return super().select(engine, io, state, layer, q, own_k, n, k, k_cap,
                                  keys=probe_k if engine.probe_is_k else None)
        chosen = np.asarray(shared)[:k]
        if engine.probe_is_k:  # the probe keys' rows are positions of R, as `take` would give them
            keys = S.gather_tokens(probe_k, jnp.asarray(padded(chosen, k_cap, io.m_pad)))
        else:
            keys = io.take(layer, K, chosen, k_cap)
        values = io.take(layer, V, chosen, k_cap)
        selection = SharedIndices(jnp.arange(k_cap, dtype=jnp.int32), k)
        return state, keys, values, selection, S.normalised_importance(scores, m), chosen[None]


class Chunks:
    """ContiguousKV (design 4.6): a period's first layer scores every head on all keys and keeps the best whole
    chunks; the period's other layers reuse that set from the state and find it prefetched (`LayerIO.plan_period`
    plans every read, so nothing is certain ahead of it)."""

    certain_reads = ()

    def selection_reads(self, engine: Engine) -> tuple:
        return (K, V)

    def select(self, engine: Engine, io: LayerIO, state, layer, q, own_k, n, k, k_cap):
        c, m, m_pad = engine.store.layout.chunk_tokens, io.m, io.m_pad
        first = layer - layer % engine.system.period_layers
        n_chunks = -(-k // c)
        k_cap = min(bucket(n_chunks * c), m_pad)
        if layer == first:
            keys = io.take_all(layer, K)
            scores = _every_head_scores(engine, io, q, keys, own_k, n)
            state, positions, count, importance = io.clock.timed(
                "identify", st.chunk_select, state, layer, scores, n_chunks, m, chunk_tokens=c,
                chunk_cap=bucket(n_chunks, minimum=4), k_cap=k_cap)
            chosen, io.period_importance = np.asarray(positions)[: int(count)], np.asarray(importance)[:m]
            io.credit(layer, K, chosen)
            io.plan_period(layer, chosen)
            keys = S.gather_tokens(keys, positions)
        else:
            state = st.reuse_selection(state, layer, first)
            chosen = np.asarray(state.selected[layer])[: int(state.count[layer])]
            keys = io.take(layer, K, chosen, k_cap, importance=io.period_importance[chosen])
        values = io.take(layer, V, chosen, k_cap, importance=io.period_importance[chosen])
        selection = SharedIndices(jnp.arange(k_cap, dtype=jnp.int32), len(chosen))
        return state, keys, values, selection, io.period_importance, chosen[None]


POLICIES = {"none": LoadAll, "h2o": H2O, "itf": ITF, "chunks": Chunks}


def policy(name: str):
    """The identification named `name` (a System's `identify`)."""
    if name not in POLICIES:
        raise SpecjaxError(f"unknown identification {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]()
