"""How a layer chooses which reused prefix tokens it keeps, and therefore what it must read: one policy per
identification a `System` names (`System.identify`).

Each policy declares `certain_reads(engine)`, the store kinds a layer reads whatever it then selects (the request's
read plan issues them for every layer at its start), `selection_reads(engine)`, the kinds it reads for the tokens it
selects (what speculation reads ahead), and `select`, which reads through the request's `LayerIO`, updates the
`ImportanceState` and returns the layer's prefix KV with its selection:

    (state, prefix_k, prefix_v, selection, importance of R [m], chosen positions of R [1 or H, k])

`policy(name)` refuses an unknown identification, so a `System` naming one fails when it is built.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from specjax.engine import state as st
from specjax.engine import steps as S
from specjax.engine.layer_io import BadChunk
from specjax.errors import SpecjaxError
from specjax.kernels import PerHeadIndices, SharedIndices, quest
from specjax.models.inference import bucket, padded
from specjax.stores import K, PROBE, V

if TYPE_CHECKING:
    from specjax.engine.engine import Engine
    from specjax.engine.layer_io import LayerIO


@functools.lru_cache(maxsize=64)
def iota(size: int) -> jax.Array:
    """0..size-1 on the device, made once per size (an eager op per layer costs the host a dispatch)."""
    return jnp.arange(size, dtype=jnp.int32)


def _every_head_scores(engine: Engine, io: LayerIO, layer, q, keys, own_k, n, columns=None):
    """H2O importance [H, m_pad] of the prefix for every query head, from all of the layer's keys (timed); or of
    the positions `columns` when `keys`' first rows are theirs (a part of the prefix)."""
    columns = io.all_positions if columns is None else columns
    scores = io.identify(S.scores, q, keys, own_k, len(columns), n,
                         kv_head_of_probe=engine.kv_of_head, impl=engine.config.kernel_impl)
    return _seen(engine, io, layer, range(engine.cfg.num_heads), "heads", columns, scores)


def _seen(engine: Engine, io: LayerIO, layer, heads, role, columns, scores):
    """The scores a layer decides from: those it computed, or a recorded run's in their place when the engine
    replays a selection trace (`Engine.selections`, `specjax.engine.replay`; a recorder keeps them). `heads`: the
    query heads of the rows; `role`: "probes" (a policy's probe heads) or "heads" (every head); `columns`: the
    positions of the reused prefix the first columns score."""
    hook = engine.selections
    return scores if hook is None else hook.scores(layer, heads, role, columns, io.m, scores)


class LoadAll:
    """No identification: every prefix token's K and V (AttentionStore, and CacheBlend's full reuse)."""

    def certain_reads(self, engine: Engine) -> tuple:
        return (K, V)

    def selection_reads(self, engine: Engine) -> tuple:
        return ()

    def select(self, engine: Engine, io: LayerIO, state, layer, q, own_k, n, k, k_cap):
        m, m_pad = io.m, io.m_pad
        keys, values = io.take_all(layer, K), io.take_all(layer, V)
        state = st.record_union(state, layer, iota(m_pad), m)
        selection = SharedIndices(iota(m_pad), m)
        return state, keys, values, selection, np.ones(m, np.float32), np.arange(m)[None]


class H2O:
    """Per-head H2O (AS+H2O): every head's scores from all keys, then the values of each head's top-k."""

    def certain_reads(self, engine: Engine) -> tuple:
        return (K,)

    def selection_reads(self, engine: Engine) -> tuple:
        return (V,)

    def select(self, engine: Engine, io: LayerIO, state, layer, q, own_k, n, k, k_cap, keys=None):
        """`keys`: the layer's K [kv_heads, m_pad, d] when the caller holds them already (else they are read)."""
        m = io.m
        keys = io.take_all(layer, K) if keys is None else keys
        scores = _every_head_scores(engine, io, layer, q, keys, own_k, n)
        state, per_head = io.identify(st.per_head_select, state, layer, scores, k, m, k_cap=k_cap)
        chosen = np.asarray(per_head)[:, :k]
        state, values = _union_values(io, state, layer, keys, np.unique(chosen), lambda slots: slots)
        return state, keys, values, PerHeadIndices(per_head, k), S.normalised_importance(scores, m), chosen


class ITF(H2O):
    """SPEC's similarity-guided identification (design 4.2): the probe heads' keys score the prefix; if the probe
    heads agree (mean pairwise Jaccard >= t = j ** alpha) every head takes their shared top-k and only its K/V
    are read; otherwise the layer falls back to per-head H2O.

    When the probe keys are every KV head's (`Engine.probe_is_k`: probe heads spread over all KV heads, as
    tiny-llama's 3 over its 2; not smollm2, whose 3 probe heads share one of its 3 KV heads), they are the layer's
    K: the shared set's keys are gathered from them, and only its V read."""

    def certain_reads(self, engine: Engine) -> tuple:
        return (PROBE,)

    def selection_reads(self, engine: Engine) -> tuple:
        return (V,) if engine.probe_is_k else (K, V)

    def select(self, engine: Engine, io: LayerIO, state, layer, q, own_k, n, k, k_cap):
        m = io.m
        probe_k = io.take_all(layer, PROBE, phase="probe_io")
        scores = io.identify(S.scores, q, probe_k, own_k, m, n, kv_head_of_probe=engine.kv_of_probe,
                             impl=engine.config.kernel_impl, q_heads=tuple(map(int, engine.probe_q)),
                             kv_heads=tuple(map(int, engine.probe_kv)))
        scores = _seen(engine, io, layer, engine.probe_q, "probes", io.all_positions, scores)
        state, shared, use_shared = io.identify(st.itf_select, state, layer, scores, k, m, engine.system.alpha,
                                                k_cap=k_cap)
        if not bool(use_shared):  # all keys: the probe keys already are, when they are every KV head's
            return super().select(engine, io, state, layer, q, own_k, n, k, k_cap,
                                  keys=probe_k if engine.probe_is_k else None)
        chosen = np.asarray(shared)[:k]
        if engine.probe_is_k:  # the probe keys' rows are positions of R, as `take` would give them
            keys = S.gather_tokens(probe_k, jnp.asarray(padded(chosen, k_cap, io.m_pad)))
        else:
            keys = io.take(layer, K, chosen, k_cap)
        values = io.take(layer, V, chosen, k_cap)
        selection = SharedIndices(iota(k_cap), k)
        return state, keys, values, selection, S.normalised_importance(scores, m), chosen[None]


class Chunks:
    """ContiguousKV (design 4.6): a period's first layer scores every head on all keys and keeps the best whole
    chunks; the period's other layers reuse that set from the state and find it prefetched (`LayerIO.plan_period`
    plans every read, so nothing is certain ahead of it)."""

    def certain_reads(self, engine: Engine) -> tuple:
        return ()

    def selection_reads(self, engine: Engine) -> tuple:
        return (K, V)

    def select(self, engine: Engine, io: LayerIO, state, layer, q, own_k, n, k, k_cap):
        c, m, m_pad = engine.store.layout.chunk_tokens, io.m, io.m_pad
        first = layer - layer % engine.system.period_layers
        n_chunks = -(-k // c)
        k_cap = min(bucket(n_chunks * c), m_pad)
        if layer == first:
            keys = io.take_all(layer, K)
            scores = _every_head_scores(engine, io, layer, q, keys, own_k, n)
            state, positions, count, importance = io.identify(
                st.chunk_select, state, layer, scores, n_chunks, m, chunk_tokens=c,
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
        selection = SharedIndices(iota(k_cap), len(chosen))
        return state, keys, values, selection, io.period_importance, chosen[None]


class GroupedITF:
    """spec_gqa (issue 22): ITF whose probes are KV heads, the unit in which keys and values are stored and read.

    Each probe KV head (the first `num_probe_heads` KV heads, one per group) scores the prefix with all of its query
    heads, their H2O scores normalised and summed; the probes' mean pairwise Jaccard is tested against t = j ** alpha
    as in ITF. Probes never share keys, so agreement is not free. On a grouped-query model a guard follows
    (`System.min_head_share`): the shared set, the top-k of the probes' summed scores, must keep that share of
    every query head's own top-k attention (`kernels.itf.head_share`), since KV heads can agree while query heads
    inside a group do not. Both holding: every head takes the shared set. Else each query head keeps its own top-k
    (per-head H2O).

    A candidate stage is optional (`System.candidates` = B): only the chunks whose key summaries (`stores.summaries`,
    host memory) bound the most attention (`kernels.quest.chunk_mass`), at least B x k positions, are scored and
    read; the rest of the prefix is never read. With B None (spec_gqa's default), or B x k covering the prefix,
    every position is a candidate, and on a model with one query head per KV head (no guard) this selects exactly
    what `ITF` selects.

    Probe keys come from the store's probe kind when its heads are these probe KV heads (one query head per KV
    head), else from K (grouped-query models: the candidates' keys of every KV head come with the chunk files)."""

    def certain_reads(self, engine: Engine) -> tuple:
        """Without a candidate stage every position is a candidate: its probe keys are read whatever the layer then
        selects. With one, what is read depends on the candidates."""
        return (self.probe_source(engine),) if engine.system.candidates is None else ()

    def selection_reads(self, engine: Engine) -> tuple:
        """A selected position's keys and values. Its keys come with its probe keys when those are every KV head's
        (read as a candidate's: already planned without a candidate stage), else they are read apart."""
        with_probe = self.probe_source(engine) == K or engine.probe_is_k
        if not with_probe:
            return (K, V)
        return (V,) if engine.system.candidates is None else (self.probe_source(engine), V)

    @staticmethod
    def probe_kv(engine: Engine) -> tuple[int, ...]:
        return tuple(range(min(engine.system.num_probe_heads, engine.cfg.num_kv_heads)))

    def probe_source(self, engine: Engine) -> int:
        """PROBE when the store's probe kind holds exactly the probe KV heads, else K."""
        return PROBE if self.probe_kv(engine) == tuple(map(int, engine.probe_kv)) else K

    def candidates(self, engine: Engine, io: LayerIO, layer, q, n, k) -> np.ndarray:
        """The positions scored: whole chunks, in order of their bounded attention mass summed over every query
        head, until B x k positions (all of them when B is None or B x k covers the prefix)."""
        budget = engine.system.candidates
        if budget is None or budget * k >= io.m:
            return io.all_positions
        chunk_of = io.locate(layer, io.all_positions).chunks
        chunks, slot_of = np.unique(chunk_of, return_inverse=True)
        got = io.clock.timed("probe_io", engine.store.key_summaries, layer, chunks)
        if not got.ok.all():
            raise BadChunk()
        summaries = np.zeros((bucket(len(chunks), minimum=4),) + got.array.shape[1:], got.array.dtype)
        summaries[: len(chunks)] = got.array
        mass = io.identify(quest.chunk_mass, q, jnp.asarray(summaries), n, len(chunks),
                           kv_of_head=engine.kv_of_head)
        keep = covering(ranked_chunks(np.asarray(mass)[:, : len(chunks)]), np.bincount(slot_of),
                        math.ceil(budget * k))
        return io.all_positions[np.isin(slot_of, keep)]

    def select(self, engine: Engine, io: LayerIO, state, layer, q, own_k, n, k, k_cap):
        m, impl = io.m, engine.config.kernel_impl
        cand = self.candidates(engine, io, layer, q, n, k)
        c = len(cand)
        # whole chunks until B x k: fewer than B x k + chunk_tokens positions, a bucket fixed by the prefix and k
        c_pad = io.m_pad if c == m else min(io.m_pad, bucket(math.ceil(engine.system.candidates * k) +
                                                             engine.store.layout.chunk_tokens))
        probe_kv = self.probe_kv(engine)
        group = engine.cfg.q_per_kv
        heads = tuple(h for g in probe_kv for h in range(g * group, (g + 1) * group))  # the probes' query heads
        stored_probe = self.probe_source(engine) == PROBE
        probe_k = io.take(layer, PROBE if stored_probe else K, cand, c_pad, phase="probe_io")
        keys = every = per_head = None  # every KV head's keys of the candidates, every query head's scores and
        # own top-k, once known
        guarded = group > 1 and engine.system.min_head_share is not None
        if stored_probe and not engine.probe_is_k:
            scores = io.identify(S.scores, q, probe_k, own_k, c, n,
                                 kv_head_of_probe=tuple(h // group for h in heads), impl=impl, q_heads=heads,
                                 kv_heads=probe_kv)
            scores = _seen(engine, io, layer, heads, "probes", cand, scores)
            probes = io.identify(st.kv_head_scores, scores, c, groups=len(probe_kv))
            # the test's threshold is j(k, c) ** alpha, the Jaccard expected of random k-sets of the c candidates
            state, shared, use_shared = io.identify(st.itf_select, state, layer, probes, k, c, engine.system.alpha,
                                                    k_cap=k_cap, kept_of=m)
            if guarded or not bool(use_shared):  # the guard and the fallback score every head
                keys = io.take(layer, K, cand, c_pad)
                every = _every_head_scores(engine, io, layer, q, keys, own_k, n, columns=cand)
            if guarded:
                state, use_shared = io.identify(st.guard_shared, state, layer, every, shared, k, c,
                                                use_shared, engine.system.min_head_share, k_cap=k_cap)
        else:  # the probe keys are every KV head's: every head's scores, and the whole decision from them in one step
            keys = probe_k
            every = _every_head_scores(engine, io, layer, q, keys, own_k, n, columns=cand)
            state, probes, shared, per_head, use_shared = io.identify(
                st.gqa_select, state, layer, every, k, c, engine.system.alpha, engine.system.min_head_share or 0.0,
                groups=len(probe_kv), probe_rows=len(heads), k_cap=k_cap, guarded=guarded, kept_of=m)
        if bool(use_shared):
            slots = np.asarray(shared)[:k]  # of the candidates
            chosen = cand[slots]
            if keys is not None:  # the set's keys are rows of the candidates' keys: taken on the device
                positions = iota(io.m_pad) if c == m else jnp.asarray(padded(cand, c_pad, -1))
                state, keys = _shared_rows(state, layer, keys, shared, k, positions)
            else:
                state = st.record_union(state, layer, jnp.asarray(padded(chosen, k_cap, -1)), k)
                keys = io.take(layer, K, chosen, k_cap)
            values = io.take(layer, V, chosen, k_cap)
            selection = SharedIndices(iota(k_cap), k)
            return (state, keys, values, selection, _on_prefix(S.normalised_importance(probes, c), cand, m),
                    chosen[None])
        if per_head is None:
            state, per_head = io.identify(st.per_head_select, state, layer, every, k, c, k_cap=k_cap, kept_of=m)
        per_head_np = np.asarray(per_head)[:, :k]
        state, values = _union_values(io, state, layer, keys, np.unique(per_head_np), lambda slots: cand[slots])
        importance = _on_prefix(S.normalised_importance(every, c), cand, m)
        return state, keys, values, PerHeadIndices(per_head, k), importance, cand[per_head_np]


@jax.jit
def _shared_rows(state, layer, keys, shared, k, positions):
    """A shared set of candidates (`shared` [k_cap], the first k valid) in one device step: the state records its
    prefix positions (`positions` of the candidates) and the candidates' keys [kv_heads, c_pad, d] give its rows
    [kv_heads, k_cap, d], zeros after the k-th."""
    valid = jnp.arange(shared.shape[0]) < k
    state = st.record_union(state, layer, jnp.where(valid, positions[shared], -1), k)
    return state, S.gather_tokens(keys, jnp.where(valid, shared, keys.shape[1]))


def ranked_chunks(mass: np.ndarray) -> np.ndarray:
    """Chunks best first by their attention mass [H, C] summed over heads (each head's normalised: one vote)."""
    return np.argsort(-mass.sum(0), kind="stable")


def covering(order: np.ndarray, sizes: np.ndarray, need: int) -> np.ndarray:
    """The first chunks of `order` that together hold at least `need` positions (`sizes`: positions per chunk);
    spec_gqa's candidates."""
    return order[: int(np.searchsorted(np.cumsum(sizes[order]), need)) + 1]


def _union_values(io: LayerIO, state, layer, keys, union, positions_of):
    """Per-head sets' values: the union's V (`union`: slots of `keys`' token axis, at prefix positions
    `positions_of(union)`) read once and placed in its slots, zeros elsewhere; the union recorded in the state."""
    positions = positions_of(union)
    state = st.record_union(state, layer, jnp.asarray(padded(positions, io.m_pad, -1)), len(union))
    union_pad = bucket(len(union))
    values = S.scatter_tokens(keys, jnp.asarray(padded(union, union_pad, keys.shape[1])),
                              io.take(layer, V, positions, union_pad))
    return state, values


def _on_prefix(importance: np.ndarray, positions: np.ndarray, m: int) -> np.ndarray:
    """Importance of the scored positions spread over all m positions of the prefix (0 where not scored)."""
    if len(positions) == m:
        return importance
    out = np.zeros(m, np.float32)
    out[positions] = importance
    return out


POLICIES = {"none": LoadAll, "h2o": H2O, "itf": ITF, "chunks": Chunks, "gqa_itf": GroupedITF}


def policy(name: str):
    """The identification named `name` (a System's `identify`)."""
    if name not in POLICIES:
        raise SpecjaxError(f"unknown identification {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]()
