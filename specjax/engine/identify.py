"""How a layer chooses which reused prefix tokens it keeps, and therefore what it must read: one policy per
identification a `System` names (`System.identify`).

A policy decides; it reads nothing and knows no engine. Its `select(facts, layer, state)` is a generator that yields
the steps its decision needs (`specjax.engine.policy_steps`: Take, TakeChosen, Decide, Score, Locate, Summaries,
Credit, PlanPeriod), one at a time, and is sent each one's result back, and returns the layer's `Selected`:

    (state, prefix_k, prefix_v, selection, importance of R [m], chosen positions of R [1 or H, k])

The engine's layer loop carries the steps out (`LayerIO.select`): it reads, times and paces them, and is the only
one that touches the store, the caches and the clock. What a policy knows of the model and system is its `Facts`,
of the request's layer its `Layer`. It also declares `certain_reads(facts)`, the store kinds a layer reads whatever it
then selects (the request's read plan issues them for every layer at its start), and `selection_reads(facts)`, the
kinds it reads for the tokens it selects (what speculation reads ahead).

A `System` names one of `POLICIES` here; `register(name)` adds one (a new file: docs/development.md, "Adding a
system"), and `policy(name)` refuses any other.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Generator

import jax
import jax.numpy as jnp
import numpy as np

from specjax.connector import PROBE, K, V
from specjax.distributed import to_host
from specjax.engine import state as st
from specjax.engine import steps as S
from specjax.engine.policy_steps import (Credit, Facts, Layer, Locate, PlanPeriod, Score, Selected, Steps, Summaries,
                                         Take, TakeChosen, decide)
from specjax.errors import SpecjaxError
from specjax.idsets import distinct
from specjax.kernels import PerHeadIndices, SharedIndices, quest
from specjax.shapes import bucket, padded


@functools.lru_cache(maxsize=64)
def iota(size: int) -> jax.Array:
    """0..size-1 on the device, made once per size (an eager op per layer costs the host a dispatch)."""
    return jnp.arange(size, dtype=jnp.int32)


def _every_head_scores(f: Facts, layer: Layer, keys, columns=None, logits: bool = False) -> Score:
    """H2O importance [H, m_pad] of the prefix for every query head, from all of the layer's keys; or of the
    positions `columns` when `keys`' first rows are theirs (a part of the prefix). `logits`: (importance, the
    logits or None), which the layer's attention over rows of `keys` weighs its values by (`_scored`)."""
    count = layer.m if columns is None else len(columns)
    return Score(S.scores, (layer.q, keys, layer.own_k, count, layer.n),
                 dict(kv_head_of_probe=f.kv_of_head, impl=f.kernel_impl, with_logits=logits),
                 heads=tuple(range(f.cfg.num_heads)), role="heads", columns=columns)


def _scored(logits, columns: PerHeadIndices) -> S.ScoredLogits | None:
    """`Selected.logits` of a layer whose query heads keep sets of their own: every head's scoring logits over the
    rows of the keys it scored, with `columns` (the selection's rows as those rows), or None where the scoring kept
    none. A shared set's attention multiplies its few keys once per KV head instead (`attention_over_logits`)."""
    return None if logits is None else S.ScoredLogits(logits, columns)


# -- the policies ------------------------------------------------------------------------------------------------


class LoadAll:
    """No identification: every prefix token's K and V (AttentionStore, and CacheBlend's full reuse)."""

    prunes = False

    def certain_reads(self, f: Facts) -> tuple:
        return (K, V)

    def selection_reads(self, f: Facts) -> tuple:
        return ()

    def select(self, f: Facts, layer: Layer, state) -> Steps:
        m, m_pad = layer.m, layer.m_pad
        keys = yield Take(K)
        values = yield Take(V)
        state = st.record_union(state, layer.index, iota(m_pad), m)
        selection = SharedIndices(iota(m_pad), m)
        return Selected(state, keys, values, selection, functools.partial(np.ones, m, np.float32), np.arange(m)[None])


class H2O:
    """Per-head H2O (AS+H2O): every head's scores from all keys, then the values of each head's top-k."""

    def certain_reads(self, f: Facts) -> tuple:
        return (K,)

    def takes_every_key(self, f: Facts) -> bool:
        """Does a layer hold every position's keys whatever it selects (per-head sets: as `Selected.keys`; a shared
        set: as `Selected.all_keys`)? A policy that does not say is taken not to (`precision.WithRest`)."""
        return True

    def selection_reads(self, f: Facts) -> tuple:
        return (V,)

    def select(self, f: Facts, layer: Layer, state, keys=None) -> Steps:
        """`keys`: the layer's K [kv_heads, m_pad, d] when the caller holds them already (else they are read)."""
        m, k = layer.m, layer.k
        keys = (yield Take(K)) if keys is None else keys
        scores, logits = yield _every_head_scores(f, layer, keys, logits=True)
        state, per_head = yield decide(st.per_head_select, state, layer.index, scores, k, m, k_cap=layer.k_cap)
        chosen = to_host(per_head)[:, :k]
        state, values = yield from _union_values(layer, state, keys, distinct(chosen), lambda slots: slots)
        selection = PerHeadIndices(per_head, k)
        return Selected(state, keys, values, selection, _importance(scores, m), chosen, _scored(logits, selection))


class ITF(H2O):
    """SPEC's similarity-guided identification (docs/systems.md): the probe heads' keys score the prefix; if the probe
    heads agree (mean pairwise Jaccard >= t = j ** alpha) every head takes their shared top-k and only its K/V
    are read; otherwise the layer falls back to per-head H2O.

    When the probe keys are every KV head's (`Facts.probe_is_k`), they are the layer's K: the shared set's keys are
    gathered from them, and only its V read."""

    threshold = True

    def certain_reads(self, f: Facts) -> tuple:
        return (PROBE,)

    def selection_reads(self, f: Facts) -> tuple:
        return (V,) if f.probe_is_k else (K, V)

    def takes_every_key(self, f: Facts) -> bool:
        return f.probe_is_k

    def select(self, f: Facts, layer: Layer, state) -> Steps:
        m, k, k_cap = layer.m, layer.k, layer.k_cap
        probe_k = yield Take(PROBE, phase="probe_io")
        scores = yield Score(S.scores, (layer.q, probe_k, layer.own_k, m, layer.n),
                             dict(kv_head_of_probe=f.kv_of_probe, impl=f.kernel_impl, q_heads=f.probe_q,
                                  kv_heads=f.probe_kv), heads=f.probe_q, role="probes")
        state, shared, use_shared = yield decide(st.itf_select, state, layer.index, scores, k, m, f.system.alpha,
                                                 k_cap=k_cap)
        taken = yield TakeChosen((V,) if f.probe_is_k else (K, V), shared, k, k_cap, when=use_shared)
        if not bool(use_shared):  # all keys: the probe keys already are, when they are every KV head's
            return (yield from super().select(f, layer, state, keys=probe_k if f.probe_is_k else None))
        chosen = np.asarray(shared)[:k]
        if f.probe_is_k:  # the probe keys' rows are positions of R, as a take would give them
            keys = S.gather_tokens(probe_k, jnp.asarray(padded(chosen, k_cap, layer.m_pad)))
            values = taken[0] if taken is not None else (yield Take(V, chosen, k_cap))
        elif taken is not None:
            keys, values = taken
        else:
            keys = yield Take(K, chosen, k_cap)
            values = yield Take(V, chosen, k_cap)
        selection = SharedIndices(iota(k_cap), k)
        return Selected(state, keys, values, selection, _importance(scores, m), chosen[None],
                        all_keys=probe_k if f.probe_is_k else None)


class Chunks:
    """ContiguousKV (docs/systems.md): a period's first layer scores every head on all keys and keeps the best whole
    chunks; the period's other layers reuse that set and its importance from the state and find it prefetched
    (`PlanPeriod` plans every read, so nothing is certain ahead of it)."""

    periods = True

    def certain_reads(self, f: Facts) -> tuple:
        return ()

    def selection_reads(self, f: Facts) -> tuple:
        return (K, V)

    def select(self, f: Facts, layer: Layer, state) -> Steps:
        c, m, m_pad = f.chunk_tokens, layer.m, layer.m_pad
        first = layer.index - layer.index % f.system.period_layers
        n_chunks = -(-layer.k // c)
        k_cap = min(bucket(n_chunks * c), m_pad)
        if layer.index == first:
            keys = yield Take(K)
            scores = yield _every_head_scores(f, layer, keys)
            state, positions, count, importance = yield decide(
                st.chunk_select, state, layer.index, scores, n_chunks, m, chunk_tokens=c,
                chunk_cap=bucket(n_chunks, minimum=4), k_cap=k_cap)
            chosen, importance = to_host(positions)[: int(count)], to_host(importance)[:m]
            yield Credit(K, chosen, importance[chosen])
            yield PlanPeriod(chosen)
            keys = S.gather_tokens(keys, positions)
        else:
            state = st.reuse_selection(state, layer.index, first)
            chosen = to_host(state.selected[layer.index])[: int(state.count[layer.index])]
            importance = to_host(state.period_importance)[:m]
            keys = yield Take(K, chosen, k_cap, importance=importance[chosen])
        values = yield Take(V, chosen, k_cap, importance=importance[chosen])
        selection = SharedIndices(iota(k_cap), len(chosen))
        return Selected(state, keys, values, selection, functools.partial(np.asarray, importance), chosen[None])


class GroupedITF:
    """spec_gqa: ITF whose probes are KV heads, the unit in which keys and values are stored and read.

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

    threshold = True
    candidate_stage = True

    def certain_reads(self, f: Facts) -> tuple:
        """Without a candidate stage every position is a candidate: its probe keys are read whatever the layer then
        selects. With one, what is read depends on the candidates."""
        return (self.probe_source(f),) if f.system.candidates is None else ()

    def selection_reads(self, f: Facts) -> tuple:
        """A selected position's keys and values. Its keys come with its probe keys when those are every KV head's
        (read as a candidate's: already planned without a candidate stage), else they are read apart."""
        with_probe = self.probe_source(f) == K or f.probe_is_k
        if not with_probe:
            return (K, V)
        return (V,) if f.system.candidates is None else (self.probe_source(f), V)

    def takes_every_key(self, f: Facts) -> bool:
        """Every position a candidate, and every KV head's keys taken: as the probe keys, or for the guard."""
        guarded = f.cfg.q_per_kv > 1 and f.system.min_head_share is not None
        return f.system.candidates is None and (self.probe_source(f) == K or f.probe_is_k or guarded)

    @staticmethod
    def probe_kv(f: Facts) -> tuple[int, ...]:
        return tuple(range(min(f.system.num_probe_heads, f.cfg.num_kv_heads)))

    def probe_source(self, f: Facts) -> int:
        """PROBE when the store's probe kind holds exactly the probe KV heads, else K."""
        return PROBE if self.probe_kv(f) == f.probe_kv else K

    def candidates(self, f: Facts, layer: Layer) -> Generator[Any, Any, np.ndarray]:
        """The positions scored: whole chunks, in order of their bounded attention mass summed over every query
        head, until B x k positions (all of them when B is None or B x k covers the prefix)."""
        budget = f.system.candidates
        if budget is None or budget * layer.k >= layer.m:
            return layer.positions
        chunk_of = (yield Locate(layer.positions)).chunks
        chunks, slot_of = distinct(chunk_of, return_inverse=True)
        got = yield Summaries(chunks)
        summaries = np.zeros((bucket(len(chunks), minimum=4),) + got.shape[1:], got.dtype)
        summaries[: len(chunks)] = got
        mass = yield decide(quest.chunk_mass, layer.q, jnp.asarray(summaries), layer.n, len(chunks),
                            kv_of_head=f.kv_of_head)
        keep = covering(ranked_chunks(to_host(mass)[:, : len(chunks)]), np.bincount(slot_of),
                        math.ceil(budget * layer.k))
        return layer.positions[np.isin(slot_of, keep)]

    def select(self, f: Facts, layer: Layer, state) -> Steps:
        m, k, k_cap, impl = layer.m, layer.k, layer.k_cap, f.kernel_impl
        cand = yield from self.candidates(f, layer)
        c = len(cand)
        # whole chunks until B x k: fewer than B x k + chunk_tokens positions, a bucket fixed by the prefix and k
        c_pad = layer.m_pad if c == m else min(layer.m_pad, bucket(math.ceil(f.system.candidates * k) +
                                                                   f.chunk_tokens))
        probe_kv = self.probe_kv(f)
        group = f.cfg.q_per_kv
        heads = tuple(h for g in probe_kv for h in range(g * group, (g + 1) * group))  # the probes' query heads
        stored_probe = self.probe_source(f) == PROBE
        probe_k = yield Take(PROBE if stored_probe else K, cand, c_pad, phase="probe_io")
        keys = every = per_head = logits = None  # every KV head's keys of the candidates, every query head's scores,
        # their logits and own top-k, once known
        guarded = group > 1 and f.system.min_head_share is not None
        if stored_probe and not f.probe_is_k:
            scores = yield Score(S.scores, (layer.q, probe_k, layer.own_k, c, layer.n),
                                 dict(kv_head_of_probe=tuple(h // group for h in heads), impl=impl, q_heads=heads,
                                      kv_heads=probe_kv), heads=heads, role="probes", columns=cand)
            probes = yield decide(st.kv_head_scores, scores, c, groups=len(probe_kv))
            # the test's threshold is j(k, c) ** alpha, the Jaccard expected of random k-sets of the c candidates
            state, shared, use_shared = yield decide(st.itf_select, state, layer.index, probes, k, c, f.system.alpha,
                                                     k_cap=k_cap, kept_of=m)
            if guarded or not bool(use_shared):  # the guard and the fallback score every head
                keys = yield Take(K, cand, c_pad)
                every, logits = yield _every_head_scores(f, layer, keys, columns=cand, logits=True)
            if guarded:
                state, use_shared = yield decide(st.guard_shared, state, layer.index, every, shared, k, c,
                                                 use_shared, f.system.min_head_share, k_cap=k_cap)
        else:  # the probe keys are every KV head's: every head's scores, and the whole decision from them in one step
            keys = probe_k
            every, logits = yield _every_head_scores(f, layer, keys, columns=cand, logits=True)
            state, probes, shared, per_head, use_shared = yield decide(
                st.gqa_select, state, layer.index, every, k, c, f.system.alpha, f.system.min_head_share or 0.0,
                groups=len(probe_kv), probe_rows=len(heads), k_cap=k_cap, guarded=guarded, kept_of=m)
        # every position a candidate: the set's values (and keys, unless at hand) taken on the device where cached
        taken = ((yield TakeChosen((V,) if keys is not None else (K, V), shared, k, k_cap, when=use_shared))
                 if c == m else None)
        if bool(use_shared):
            slots = np.asarray(shared)[:k]  # of the candidates
            chosen = cand[slots]
            all_keys = keys if c == m else None
            if keys is not None:  # the set's keys are rows of the candidates' keys: taken on the device
                positions = iota(layer.m_pad) if c == m else jnp.asarray(padded(cand, c_pad, -1))
                state, keys = _shared_rows(state, layer.index, keys, shared, k, positions)
            else:
                state = st.record_union(state, layer.index, jnp.asarray(padded(chosen, k_cap, -1)), k)
                keys = taken[0] if taken is not None else (yield Take(K, chosen, k_cap))
            values = taken[-1] if taken is not None else (yield Take(V, chosen, k_cap))
            selection = SharedIndices(iota(k_cap), k)
            return Selected(state, keys, values, selection, _importance(probes, c, cand, m), chosen[None],
                            all_keys=all_keys)
        if per_head is None:
            state, per_head = yield decide(st.per_head_select, state, layer.index, every, k, c, k_cap=k_cap, kept_of=m)
        per_head_np = to_host(per_head)[:, :k]
        state, values = yield from _union_values(layer, state, keys, distinct(per_head_np), lambda slots: cand[slots])
        selection = PerHeadIndices(per_head, k)
        return Selected(state, keys, values, selection, _importance(every, c, cand, m), cand[per_head_np],
                        _scored(logits, selection))


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


def _union_values(layer: Layer, state, keys, union, positions_of) -> Generator[Any, Any, tuple]:
    """Per-head sets' values: the union's V (`union`: slots of `keys`' token axis, at prefix positions
    `positions_of(union)`) read once and placed in its slots, zeros elsewhere; the union recorded in the state."""
    positions = positions_of(union)
    union_pad = bucket(len(union))
    rows = yield Take(V, positions, union_pad)
    return S.record_and_place_union(state, layer.index, padded(positions, layer.m_pad, -1), len(union), keys,
                                    padded(union, union_pad, keys.shape[1]), rows)


def _importance(scores, n: int, positions: np.ndarray | None = None, m: int | None = None
                ) -> Callable[[], np.ndarray]:
    """`Selected.importance` from a layer's scores [R, >= n] of n scored positions (`positions` of the m-token prefix;
    None: all of it, n = m): each row normalised, their mean, 0 at every position not scored. Made when called."""
    return functools.partial(_importance_now, scores, n, positions, m)


def _importance_now(scores, n: int, positions: np.ndarray | None, m: int | None) -> np.ndarray:
    importance = S.normalised_importance(scores, n)
    if positions is None or len(positions) == m:
        return importance
    out = np.zeros(m, np.float32)
    out[positions] = importance
    return out


# identification name -> policy class, what a `System`'s `identify` names; `register` adds one
POLICIES = {"none": LoadAll, "h2o": H2O, "itf": ITF, "chunks": Chunks, "gqa_itf": GroupedITF}

# What a policy class may declare about itself as class attributes, and the value a class that does not declare one
# has: `prunes`, it keeps a share of the prefix (--retention); `threshold`, ITF's agreement test (its alpha and SPEC's
# ablations apply); `candidate_stage`, spec_gqa's key-summary candidates; `periods`, ContiguousKV's period plan
# (its chunk, period and sub-period sizes apply, and it goes with the `periods` prefetch).
TRAITS = {"prunes": True, "threshold": False, "candidate_stage": False, "periods": False}


def trait(name: str, what: str) -> bool:
    """What the identification `name` declares about itself (`TRAITS`)."""
    return bool(getattr(POLICIES[name], what, TRAITS[what]))


def register(name: str):
    """Class decorator: the policy becomes the identification `name` a `System` may name (its module imported before
    such a system is made). A name already taken is refused."""
    def add(cls):
        if name in POLICIES:
            raise SpecjaxError(f"identification {name!r} is taken (by {POLICIES[name].__name__}); pick another name")
        for method in ("certain_reads", "selection_reads", "select"):
            if not callable(getattr(cls, method, None)):
                raise SpecjaxError(f"policy {cls.__name__} has no {method}(); see specjax.engine.identify")
        POLICIES[name] = cls
        return cls
    return add


def policy(name: str):
    """The identification named `name` (a System's `identify`)."""
    if name not in POLICIES:
        raise SpecjaxError(f"unknown identification {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]()
