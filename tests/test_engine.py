"""The prefill engine and its systems on random tiny OPT and Llama models with an in-memory store."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

import specjax
from specjax.engine import Engine, EngineConfig, Request, fingerprint, make_system
from specjax.engine import identify, speculation
from specjax.engine.policy_steps import Take
from specjax.engine import state as st
from specjax.errors import SpecjaxError
from specjax.kernels import itf_threshold
from specjax.models import transformer as T
from specjax.stores import K, PROBE, V, KVStore
from specjax.stores.kvarray import low_bit

TOL = 1e-4
EXACT = 1e-5  # fp32: the same computation over the same KV, up to summation order


@pytest.fixture(scope="module", params=["tiny-opt", "tiny-llama"])
def model(request):
    return specjax.load_model(request.param, init="random", seed=1)


def _store(model, chunk_tokens=16, kv_bits=()):
    spec = {"driver": "memory", "path": f"kv{np.random.randint(1 << 30)}/"}
    return KVStore.open(spec, fingerprint(model, chunk_tokens, kv_bits), context=ts.Context())


def _request(model, prefix_len=100, query_len=7, seed=0):
    rng = np.random.default_rng(seed)
    v = model.config.vocab_size
    return Request(rng.integers(0, v, prefix_len).tolist(), rng.integers(0, v, query_len).tolist(),
                   [rng.integers(0, v, 3).tolist(), rng.integers(0, v, 6).tolist()])


def _engine(model, name, retention=1.0, **cfg):
    system = make_system(name)
    store = _store(model) if system.reuse else None
    config = EngineConfig(retention=retention, gpu_cache_bytes=64 << 10, cpu_cache_bytes=64 << 10, trace=True, **cfg)
    return Engine(model, system, store, config)


def _run(model, name, req, retention=1.0):
    engine = _engine(model, name, retention)
    if engine.store is not None:
        engine.warm(req.prefix)
    return engine.run(req)


def test_recompute_matches_plain_forward(model):
    req = _request(model)
    r = _run(model, "recompute", req)
    np.testing.assert_allclose(r.first_token_logits, model.logits(req.prefix + req.query)[-1], atol=TOL, rtol=0)
    for (ours, greedy), cont in zip(r.continuation_logprobs, req.continuations):
        ref, ref_greedy = model.loglikelihood(req.prefix + req.query, cont)
        assert ours == pytest.approx(ref, abs=TOL) and greedy == ref_greedy
    assert r.reused_tokens == 0 and r.computed_tokens == len(req.prefix) + len(req.query)


@pytest.mark.parametrize("name", ["recompute", "as_full"])
def test_chunked_prefill_matches_plain_forward(model, name):
    """More new tokens than one prefill chunk (3 whole chunks and a partial one): recompute, and a cold request
    that writes its prefix behind, equal the plain forward; the stored KV serves the next request exactly."""
    req = _request(model, prefix_len=100, query_len=7)  # 107 tokens in chunks of 32: 32 + 32 + 32 + 11
    engine = _engine(model, name, prefill_chunk_tokens=32)
    r = engine.run(req)
    assert r.reused_tokens == 0 and r.computed_tokens == 107
    context = req.prefix + req.query
    np.testing.assert_allclose(r.first_token_logits, model.logits(context)[-1], atol=TOL, rtol=0)
    for (ours, greedy), cont in zip(r.continuation_logprobs, req.continuations):
        ref, ref_greedy = model.loglikelihood(context, cont)
        assert ours == pytest.approx(ref, abs=TOL) and greedy == ref_greedy
    block = _engine(model, name, prefill_chunk_tokens=0).run(req)  # one block: the same KV, the same scores
    np.testing.assert_allclose(r.first_token_logits, block.first_token_logits, atol=TOL, rtol=0)
    np.testing.assert_allclose([c for c, _ in r.continuation_logprobs],
                               [c for c, _ in block.continuation_logprobs], atol=TOL, rtol=0)
    if engine.store is not None:  # the chunks' KV was written behind: the next request reuses it
        again = engine.run(Request(req.prefix, req.query[:3]))
        assert again.reused_tokens == len(req.prefix)
        np.testing.assert_allclose(again.first_token_logits, model.logits(req.prefix + req.query[:3])[-1],
                                   atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["as_full", "spec", "impress", "as_h2o_lfu", "as_h2o_lru"])
def test_full_retention_equals_recompute(model, name):
    """Reusing every stored token through the read scheduler, the coalesced reads and the batched copies gives
    recompute's outputs to fp32 rounding."""
    req = _request(model)
    base = _run(model, "recompute", req)
    r = _run(model, name, req, retention=1.0)
    assert r.reused_tokens == len(req.prefix) and r.computed_tokens == len(req.query)
    np.testing.assert_allclose(r.first_token_logits, base.first_token_logits, atol=EXACT, rtol=0)
    np.testing.assert_allclose([c for c, _ in r.continuation_logprobs],
                               [c for c, _ in base.continuation_logprobs], atol=EXACT, rtol=0)


def test_second_request_reuses_the_stored_prefix(model):
    req = _request(model)
    engine = _engine(model, "as_full")
    first = engine.run(req)  # cold store: the whole prefix is computed and written behind
    assert first.reused_tokens == 0 and first.computed_tokens == len(req.prefix) + len(req.query)
    assert first.io["disk_bytes_written"] > 0 and first.io["disk_bytes"] == 0
    second = engine.run(Request(req.prefix, req.query[:3], req.continuations))
    assert second.reused_tokens == len(req.prefix) and second.computed_tokens == 3
    assert second.io["disk_bytes_written"] == 0
    assert second.io["disk_bytes"] + second.io["device_hits"] + second.io["host_hits"] > 0
    ref = model.logits(req.prefix + req.query[:3])[-1]
    np.testing.assert_allclose(second.first_token_logits, ref, atol=TOL, rtol=0)


def test_partial_match_stores_the_new_tail(model):
    req = _request(model, prefix_len=90)
    engine = _engine(model, "as_full")
    engine.warm(req.prefix[:40])
    r = engine.run(req)
    assert r.reused_tokens == 40 and r.computed_tokens == 50 + len(req.query)
    np.testing.assert_allclose(r.first_token_logits, model.logits(req.prefix + req.query)[-1], atol=TOL, rtol=0)
    again = engine.run(req)
    assert again.reused_tokens == 90


def _h2o_reference(model, req, retention):
    """Per layer, each head's H2O top-k over R from the query rows, attending only to its own set."""
    cfg, params = model.config, model.params
    m, n = len(req.prefix), len(req.query)
    k = math.ceil(retention * m)
    tokens = jnp.asarray(req.prefix + req.query)
    positions = jnp.arange(m + n)
    h = T.embed(cfg, params, tokens, positions)
    group = cfg.num_heads // cfg.num_kv_heads
    sets = []
    for lp in params["layers"]:
        q, kk, vv = T.project(cfg, lp, h, positions)
        keys = jnp.repeat(kk, group, axis=0)
        values = jnp.repeat(vv, group, axis=0)
        scores = jnp.einsum("hqd,hkd->hqk", q[:, m:], keys) * cfg.head_dim ** -0.5
        causal = positions[None, :] <= positions[m:, None]
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        importance = np.asarray(probs[:, :, :m].sum(1))
        chosen = np.argsort(-importance, axis=1, kind="stable")[:, :k]
        sets.append(np.sort(chosen, axis=1))
        keep = np.zeros((cfg.num_heads, m + n), bool)
        np.put_along_axis(keep, chosen, True, axis=1)
        keep[:, m:] = True
        mask = causal[None] & jnp.asarray(keep)[:, None, :]
        pruned = jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1), values)
        # Prefix rows are the stored, exact prefix (they never see the query); query rows use the pruned set.
        exact = T.attention(q[:, :m], kk[:, :m], vv[:, :m], positions[:m], positions[:m])
        h = jnp.concatenate([T.output_and_mlp(cfg, lp, h[:m], exact), T.output_and_mlp(cfg, lp, h[m:], pruned)])
    return sets, np.asarray(T.head(cfg, params, h[-1:]))[0]


@pytest.mark.parametrize("name", ["as_h2o_lru", "as_h2o_lfu"])
def test_h2o_selects_the_per_head_top_k(model, name):
    req = _request(model, prefix_len=80, query_len=6, seed=3)
    retention = 0.25
    r = _run(model, name, req, retention)
    ref_sets, ref_logits = _h2o_reference(model, req, retention)
    k = math.ceil(retention * len(req.prefix))
    for layer, (ours, ref) in enumerate(zip(r.selections, ref_sets)):
        assert ours.shape == (model.config.num_heads, k)
        np.testing.assert_array_equal(np.sort(ours, axis=1), ref, err_msg=f"layer {layer}")
    np.testing.assert_allclose(r.first_token_logits, ref_logits, atol=TOL, rtol=0)
    assert all(r.layers["fallback"])


def test_itf_threshold_decision_on_hand_built_scores():
    m, k = 64, 16
    state = st.ImportanceState.init(2, m)
    agree = np.zeros((3, m), np.float32)
    agree[:, :k] = np.linspace(2.0, 1.0, k)  # all three probe heads rank tokens 0..15 highest
    state, shared, use_shared = st.itf_select(state, 0, jnp.asarray(agree), k, m, 0.6, k_cap=k)
    assert bool(use_shared)
    np.testing.assert_array_equal(np.sort(np.asarray(shared)), np.arange(k))
    j = (k * k / m) / (2 * k - k * k / m)
    assert float(state.threshold[0]) == pytest.approx(j ** 0.6, rel=1e-6)
    assert float(state.jaccard[0]) == pytest.approx(1.0)
    disagree = np.zeros((3, m), np.float32)
    for head in range(3):  # disjoint sets: Jaccard 0 < t
        disagree[head, head * k:(head + 1) * k] = 1.0
    state, _, use_shared = st.itf_select(state, 1, jnp.asarray(disagree), k, m, 0.6, k_cap=k)
    assert not bool(use_shared) and bool(state.fallback[1]) and float(state.jaccard[1]) == 0.0
    # Partial overlap: decided by J >= t exactly as the formula says.
    partial = np.zeros((3, m), np.float32)
    for head in range(3):
        partial[head, head * 4:head * 4 + k] = 1.0 + np.arange(k)[::-1] * 1e-3
    state, _, use_shared = st.itf_select(state, 1, jnp.asarray(partial), k, m, 2.0, k_cap=k)
    expected = float(state.jaccard[1]) >= float(itf_threshold(k, m, 2.0))
    assert bool(use_shared) == expected


def test_itf_falls_back_when_probe_heads_disagree(model):
    """With alpha = 0 the threshold is 1: any disagreement between probe heads falls back to all keys."""
    req = _request(model, prefix_len=96, seed=5)
    engine = Engine(model, make_system("impress", alpha=0.0), _store(model),
                    EngineConfig(retention=0.25, trace=True))
    engine.warm(req.prefix)
    r = engine.run(req)
    fell_back = [layer for layer, f in enumerate(r.layers["fallback"]) if f]
    assert fell_back, "random tiny models' probe heads should disagree somewhere"
    for layer in fell_back:
        assert r.selections[layer].shape[0] == model.config.num_heads  # per-head sets
    for layer in set(range(model.config.num_layers)) - set(fell_back):
        assert r.layers["jaccard"][layer] >= 1.0 - 1e-6


def test_a_fallback_layer_reads_no_keys_when_the_probe_keys_are_every_kv_head(model):
    """ITF's fallback scores every head on all keys. When the probe heads' keys are every KV head's (tiny-llama: 2 KV
    heads under 3 probe heads) they are those keys, so the layer reads no K, with the same logits as reading them;
    otherwise (tiny-opt: 3 of 4 KV heads) it reads K."""
    req = _request(model, prefix_len=96, seed=5)
    config = EngineConfig(retention=0.25, gpu_cache_bytes=0, cpu_cache_bytes=0, trace=True)
    runs = {}
    for reuse in (True, False):
        engine = Engine(model, make_system("impress", alpha=0.0), _store(model), config)
        engine.warm(req.prefix)
        engine.facts = dataclasses.replace(engine.facts, probe_is_k=engine.facts.probe_is_k and reuse)
        reads, read_runs = [], engine.store.read_runs

        def recording(layer, kind, chunks, **kw):
            reads.append((layer, kind))
            return read_runs(layer, kind, chunks, **kw)

        engine.store.read_runs = recording
        runs[reuse] = engine.run(req), {layer for layer, kind in reads if kind == K}
    (r, k_layers), (plain, plain_k_layers) = runs[True], runs[False]
    fell_back = {layer for layer, f in enumerate(r.layers["fallback"]) if f}
    assert fell_back and plain_k_layers == fell_back
    assert k_layers == (set() if model.config.num_kv_heads == 2 else fell_back)
    np.testing.assert_allclose(r.first_token_logits, plain.first_token_logits, atol=TOL, rtol=0)


def test_a_shared_set_reads_no_keys_when_the_probe_keys_are_every_kv_head(model):
    """On the shared path too, probe keys that are every KV head's are the layer's K: spec gathers the set's keys
    from them and reads (and speculates) only V, with the same logits as reading K; tiny-opt reads K."""
    req = _request(model, prefix_len=128, seed=7)
    runs = {}
    for reuse in (True, False):
        engine = Engine(model, make_system("spec", alpha=50.0), _store(model),
                        EngineConfig(retention=0.25, gpu_cache_bytes=0, cpu_cache_bytes=0))
        engine.warm(req.prefix)
        engine.facts = dataclasses.replace(engine.facts, probe_is_k=engine.facts.probe_is_k and reuse)
        reads, read_runs = [], engine.store.read_runs

        def recording(layer, kind, chunks, **kw):
            reads.append((kind, bool(kw.get("speculative"))))
            return read_runs(layer, kind, chunks, **kw)

        engine.store.read_runs = recording
        runs[reuse] = engine.run(req), reads
    (r, reads), (plain, plain_reads) = runs[True], runs[False]
    assert not any(r.layers["fallback"])
    assert (K, False) in plain_reads and (K, True) in plain_reads  # taken and speculated
    assert ((K, False) in reads) == ((K, True) in reads) == (model.config.num_kv_heads != 2)
    assert (V, True) in reads and r.prefetch["prefetch_used"] > 0
    np.testing.assert_allclose(r.first_token_logits, plain.first_token_logits, atol=TOL, rtol=0)


@pytest.mark.parametrize("name,bits", [("spec", None), ("spec_gqa", None), ("spec", 4)])
@pytest.mark.parametrize("tier", ["device", "host"])
def test_a_cached_shared_set_is_taken_on_the_device_with_the_same_kv_and_counts(model, name, bits, tier):
    """Once the caches hold a prefix (after its first request), a layer's shared set is gathered by the device from
    their pages (TakeChosen, `chosen_on_device_bytes`), the host tier's in place on a CPU device: the answer is the
    one of the same system reading every set through takes (caches off), bit for bit, and it uses what those used. At
    4 bits the keys decode with their chunks' ranges, gathered from the pages too."""
    req = _request(model, prefix_len=128, seed=7)
    budget = {"gpu_cache_bytes": 8 << 20, "cpu_cache_bytes": 0} if tier == "device" else \
        {"gpu_cache_bytes": 0, "cpu_cache_bytes": 8 << 20}
    runs = {}
    for cached in (True, False):
        system = make_system(name, alpha=50.0, kv_bits=bits)
        engine = Engine(model, system, _store(model, kv_bits=system.store_bits),
                        EngineConfig(retention=0.25, trace=True, **(budget if cached else {})))
        engine.warm(req.prefix)
        runs[cached] = [engine.run(req) for _ in range(3)]
    cold, *warm = runs[True]
    assert cold.io["chosen_on_device_bytes"] == 0  # nothing cached yet: every set through takes
    for ours, plain in zip(runs[True], runs[False]):
        assert not any(ours.layers["fallback"])
        np.testing.assert_array_equal(ours.first_token_logits, plain.first_token_logits)
        assert ours.continuation_logprobs == plain.continuation_logprobs
        for a, b in zip(ours.selections, plain.selections):
            np.testing.assert_array_equal(a, b)
        assert ours.io["used_token_bytes"] == plain.io["used_token_bytes"]
    lay = engine.store.layout
    kinds = (K, V) if bits is None else (low_bit(K, bits), low_bit(V, bits))
    for r in warm:
        shared = model.config.num_layers * 32 * min(lay.token_nbytes(kind) for kind in kinds)  # a kind's rows
        assert r.io["chosen_on_device_bytes"] >= shared and r.io["disk_bytes"] == 0
        assert r.io["device_hits" if tier == "device" else "host_hits"] > 0 and r.io["misses"] == 0


def test_a_failure_after_a_set_was_taken_on_the_device_leaves_no_page_pinned(model, monkeypatch):
    """The slots a device-taken set pinned are let go whatever fails before its uses are counted: a later request
    still finds every page free to be replaced."""
    req = _request(model, prefix_len=128, seed=7)
    engine = Engine(model, make_system("spec", alpha=50.0), _store(model),
                    EngineConfig(retention=0.25, gpu_cache_bytes=8 << 20, cpu_cache_bytes=0))
    engine.warm(req.prefix)
    engine.run(req)
    pool = engine.prefetcher.pool

    def failing(resident, positions):
        assert any(pages.pinned for pages in pool._pages.values())  # the set's slots are held until now
        raise RuntimeError("accounting failed")

    monkeypatch.setattr(engine.prefetcher, "took_resident", failing)
    with pytest.raises(RuntimeError, match="accounting failed"):
        engine.run(req)
    assert not any(pages.pinned for pages in pool._pages.values())
    monkeypatch.undo()
    assert engine.run(req).io["chosen_on_device_bytes"] > 0


def test_spec_shares_sets_loads_less_and_scores_its_prefetch(model):
    """A large alpha makes t ~ 0, so every layer shares one set: probe keys + k of m tokens' K and V are read."""
    req = _request(model, prefix_len=128, seed=7)
    full = _run(model, "as_full", req)
    engine = Engine(model, make_system("spec", alpha=50.0), _store(model), EngineConfig(retention=0.25, trace=True))
    engine.warm(req.prefix)
    spec = engine.run(req)
    cfg, m, k = model.config, 128, 32
    assert not any(spec.layers["fallback"])
    probe_heads = len(engine.probe_kv)
    per_token_head = cfg.head_dim * 4  # float32
    kinds = 1 if engine.facts.probe_is_k else 2  # V, and K unless the probe keys are every KV head's K
    expected = cfg.num_layers * per_token_head * (probe_heads * m + kinds * cfg.num_kv_heads * k)
    assert spec.io["used_token_bytes"] == expected < full.io["used_token_bytes"]
    p = spec.prefetch
    # Layers 1..L-1 were guessed from the previous layer's set: with no reordering, every token of the
    # chunks that set occupies (16-token chunks) is prefetched.
    c, sets = 16, [np.asarray(sel).ravel() for sel in spec.selections]
    guessed = [np.unique(prev // c) for prev in sets[:-1]]
    assert p["prefetch_issued"] == c * sum(len(g) for g in guessed)
    assert p["prefetch_needed"] == (cfg.num_layers - 1) * k
    assert p["prefetch_guess_hits"] == sum(np.isin(cur // c, g).sum() for g, cur in zip(guessed, sets[1:]))
    assert p["prefetch_used"] <= p["prefetch_guess_hits"] and p["prefetch_ahead"] <= p["prefetch_issued"]
    assert p["precision"] == pytest.approx(p["prefetch_used"] / max(p["prefetch_ahead"], 1))
    assert p["recall"] == pytest.approx(p["prefetch_used"] / p["prefetch_needed"])
    assert all(len(np.intersect1d(a, b)) <= k for a, b in zip(spec.selections, spec.selections[1:]))


@pytest.mark.parametrize("late", [False, True])
def test_prefetch_counts_as_read_ahead_only_what_was_on_its_way_when_the_layer_took_it(model, late):
    """A guessed token whose V chunk still waited in the disk's queue when its layer took its V was not read ahead:
    the guess named it (guess_hits), but it is neither `ahead` nor `used`; precision and recall count what was."""
    req = _request(model, prefix_len=128, seed=7)
    engine = Engine(model, make_system("spec", alpha=50.0), _store(model),
                    EngineConfig(retention=0.25, gpu_cache_bytes=0, cpu_cache_bytes=0))
    engine.warm(req.prefix)
    ahead = engine.prefetcher.ahead
    engine.prefetcher.ahead = lambda layer, kind, chunks: (
        np.zeros(len(chunks), bool) if late and kind == V else np.ones(len(chunks), bool))
    p = engine.run(req).prefetch
    engine.prefetcher.ahead = ahead
    assert p["prefetch_guess_hits"] > 0
    assert p["prefetch_ahead"] == (0 if late else p["prefetch_issued"])
    assert p["prefetch_used"] == (0 if late else p["prefetch_guess_hits"])
    assert p["recall"] == pytest.approx(p["prefetch_used"] / p["prefetch_needed"])
    assert p["guess_recall"] == pytest.approx(p["prefetch_guess_hits"] / p["prefetch_needed"])


@pytest.mark.parametrize("name, certain", [("as_full", (K, V)), ("as_h2o_lfu", (K,)), ("spec", (PROBE,)),
                                           ("spec_gqa", (PROBE,))])
def test_every_layers_certain_reads_are_planned_at_the_request_start(model, name, certain):
    """The reads each layer needs whatever it selects are all requested on demand, in layer order, and before any
    other read of that layer (the request's read plan); no layer's certain reads are requested again; nothing past
    the last layer."""
    req = _request(model, prefix_len=64, seed=3)
    engine = _engine(model, name, retention=0.25)
    engine.warm(req.prefix)
    calls = []
    request = engine.prefetcher.request

    def recording(match, layer, kind, positions=None, **options):
        calls.append((layer, kind, options.get("speculative", False)))
        return request(match, layer, kind, positions, **options)

    engine.prefetcher.request = recording
    engine.run(req)
    num_layers = model.config.num_layers
    plan = [(layer, kind, False) for layer in range(num_layers) for kind in certain]
    assert [c for c in calls if c[1] in certain and not c[2]] == plan  # never asked on demand again
    for layer in range(num_layers):
        of_layer = [c for c in calls if c[0] == layer]
        assert of_layer[:len(certain)] == [(layer, kind, False) for kind in certain]
    assert max(layer for layer, _, _ in calls) == num_layers - 1


class _TakesKTwice(identify.LoadAll):
    """as_full's policy, taking a set's keys (the first half of the prefix) before every position's."""

    def select(self, f, layer, state):
        half = np.arange(layer.m // 2)
        yield Take(K, half, len(half))
        return (yield from super().select(f, layer, state))


def test_a_layer_taking_a_kind_twice_reads_each_chunk_once(model):
    """A certain read stays held until its layer's identification is done: a policy that takes a kind twice in a
    layer (a set's rows, then every position's) reads each chunk once, caches off, and attends to the same KV."""
    req = _request(model, prefix_len=96, seed=5)
    config = EngineConfig(retention=1.0, gpu_cache_bytes=0, cpu_cache_bytes=0, trace=True)
    engine = Engine(model, make_system("as_full"), _store(model), config)
    engine.warm(req.prefix)
    plain = engine.run(req)
    engine.identification = _TakesKTwice()
    reads, read_runs = [], engine.store.read_runs

    def recording(layer, kind, chunks, **kw):
        reads.extend((layer, kind, int(c)) for c in chunks)
        return read_runs(layer, kind, chunks, **kw)

    engine.store.read_runs = recording
    twice = engine.run(req)
    assert reads and len(reads) == len(set(reads))
    assert twice.io["disk_bytes"] == plain.io["disk_bytes"]
    np.testing.assert_array_equal(twice.first_token_logits, plain.first_token_logits)


class _Fails(identify.LoadAll):
    """as_full's policy, failing once it has taken a layer's keys."""

    def select(self, f, layer, state):
        yield Take(K)
        raise ValueError("the layer's own error")


def test_a_layers_own_error_is_not_replaced_by_letting_go_of_its_reads(model, monkeypatch):
    """A layer's identification that fails lets go of its held reads, and what letting go raises (the read plan's
    error, which it re-raises) does not replace the layer's own: a bad chunk found there is recomputed, not fatal."""
    from specjax.engine import layer_io

    req = _request(model, prefix_len=96, seed=5)
    engine = _engine(model, "as_full")
    engine.warm(req.prefix)
    engine.identification = _Fails()
    let_go = []

    def failing(self, layer):
        let_go.append(layer)
        raise RuntimeError("the read plan's error")

    monkeypatch.setattr(layer_io.LayerIO, "let_go_certain", failing)
    with pytest.raises(ValueError, match="the layer's own error"):
        engine.run(req)
    assert let_go == [0]


@pytest.mark.parametrize("name", ["as_full", "spec"])
def test_a_layers_held_reads_are_let_go_once_it_has_identified(model, held_behind, name):
    """A layer's certain reads are held only until its identification is done, not to the request's end (their
    landing buffers would pile up over the layers)."""
    req = _request(model, prefix_len=96, seed=6)
    engine = _engine(model, name, retention=0.5)
    engine.warm(req.prefix)
    engine.run(req)
    assert not held_behind


def test_the_plan_is_issued_beside_the_first_layers_and_a_take_waits_for_its_layers_plan(model, monkeypatch):
    """Issuing the read plan (host work per layer) runs on the engine's I/O worker: the request's thread takes layer
    0 while later layers' reads are still being issued, and never takes a layer before its planned reads are."""
    import threading
    import time

    from specjax.engine import layer_io

    req = _request(model, prefix_len=64, seed=4)
    engine = _engine(model, "as_full")
    engine.warm(req.prefix)
    engine.run(req)  # compiled: the patched run below is the host's work only
    events = []
    certain = layer_io.LayerIO._request_certain
    take = layer_io.LayerIO.take

    def slow_certain(self, layer):
        time.sleep(0.2)
        certain(self, layer)
        events.append(("planned", layer, threading.current_thread() is threading.main_thread()))

    def recording_take(self, layer, kind, *args, **kwargs):
        events.append(("take", layer, threading.current_thread() is threading.main_thread()))
        out = take(self, layer, kind, *args, **kwargs)
        events.append(("took", layer, True))
        return out

    monkeypatch.setattr(layer_io.LayerIO, "_request_certain", slow_certain)
    monkeypatch.setattr(layer_io.LayerIO, "take", recording_take)
    result = engine.run(req)
    reference = _run(model, "recompute", req)
    np.testing.assert_allclose(result.first_token_logits, reference.first_token_logits, atol=EXACT * 10, rtol=0)
    planned = [e for e in events if e[0] == "planned"]
    assert [layer for _, layer, _ in planned] == list(range(model.config.num_layers))
    assert not any(on_main for _, _, on_main in planned)  # issued by the worker
    first_take = events.index(next(e for e in events if e[0] == "take"))
    assert first_take < events.index(planned[-1])  # layer 0 taken while the last layer's plan was still to come
    for i, (what, layer, _) in enumerate(events):
        if what == "took":
            assert ("planned", layer, False) in events[:i]


def test_unknown_system():
    with pytest.raises(SpecjaxError, match="unknown system 'magic'; known systems: recompute, as_full"):
        make_system("magic")


def test_ablations_change_the_policy():
    s = make_system("spec", no_itf=True, no_reorder=True, no_score_cache=True, no_prefetch=True)
    assert (s.identify, s.reorder, s.cache_policy, s.prefetch.name) == ("h2o", False, "lfu", "certain")
    assert s.name == "spec-no_itf-no_reorder-no_score_cache-no_prefetch"


def test_options_change_only_the_systems_they_concern():
    """A SystemOptions field leaves a system it does not concern as it is, and a system's name tells what changed."""
    assert make_system("as_full", no_itf=True, alpha=0.8, gqa_candidates=2, blend_ratio=0.5) == make_system("as_full")
    assert make_system("impress", no_prefetch=True) == make_system("impress")  # it has no speculation to turn off
    assert make_system("impress", no_itf=True, no_prefetch=True).name == "impress-no_itf"
    gqa = make_system("spec_gqa", gqa_candidates=2, no_prefetch=True, no_reorder=True)  # SPEC's ablations reach it
    assert (gqa.name, gqa.candidates, gqa.prefetch.name, gqa.reorder) == ("spec_gqa-candidates2-no_reorder-no_prefetch",
                                                                      2.0, "certain", False)
    assert make_system("spec_gqa", alpha=0.8).alpha == 0.8 and make_system("spec", alpha=0.8).name == "spec"
    with pytest.raises(SpecjaxError, match="alpha must be >= 0"):
        make_system("spec", alpha=-1)
    with pytest.raises(TypeError, match="no_such_option"):
        make_system("spec", no_such_option=True)


def test_reordered_store_serves_the_same_kv(model):
    """After SPEC's reordering repacks the prefix's chunks, reading through the mapping list is exact."""
    req = _request(model, prefix_len=100, seed=11)
    engine = _engine(model, "impress", retention=0.25)
    engine.warm(req.prefix)
    engine.run(req)  # records importance for the node; fills the caches
    cached_before = {k[2] for tier in engine.cache.tiers.values() for k in tier.items}
    assert engine.reorder() >= 1
    live = {c for seg in engine.store.segments(referenced=True)
            for c in range(seg.first_chunk, seg.first_chunk + seg.n_chunks)}
    assert cached_before and not cached_before & live  # every chunk cached before was repacked away ...
    assert all(k[2] in live for tier in engine.cache.tiers.values() for k in tier.items)  # ... and dropped
    full = Engine(model, make_system("impress"), engine.store, EngineConfig(retention=1.0))
    r = full.run(req)
    np.testing.assert_allclose(r.first_token_logits, model.logits(req.prefix + req.query)[-1], atol=TOL, rtol=0)


@pytest.mark.parametrize("first", [0, 37])
def test_a_requests_locations_are_the_stores_on_a_reordered_store(model, first):
    """LayerIO locates every position of the match once per layer and indexes sets out of that: the same chunks
    and offsets as the store's own lookup, per layer of a store that SPEC's reordering repacked (each layer in its
    own order), past a computed head of `first` tokens; a position outside the match is refused."""
    from specjax.engine.clock import Clock
    from specjax.engine.layer_io import LayerIO

    req = _request(model, prefix_len=100, seed=12)
    engine = _engine(model, "spec", retention=0.25)
    engine.warm(req.prefix)
    engine.run(req)
    assert engine.reorder() >= 1
    rng = np.random.default_rng(0)
    with engine.store.match(req.prefix) as match:
        m = match.length - first
        io = LayerIO(engine.read_path(), match, m, m, Clock(), first=first)
        orders = set()
        for layer in range(model.config.num_layers):
            positions = rng.permutation(m)[: m // 3]
            got, want = io.locate(layer, positions), engine.store.locate(match, positions + first, layer)
            np.testing.assert_array_equal(got.chunks, want.chunks)
            np.testing.assert_array_equal(got.offsets, want.offsets)
            orders.add(io.locate(layer, np.arange(m)).offsets.tobytes())
        assert len(orders) > 1  # the layers' orders differ: a table shared by all layers would fail above
        with pytest.raises(IndexError, match="matched prefix"):
            io.locate(0, [m])


def test_speculations_bookkeeping_waits_for_the_first_token(model, monkeypatch):
    """Which chunks each layer needed (for later requests' speculation) and how its guess did are worked out after
    the first token: nothing of the request's layers waits on them, and the report still counts every layer."""
    from specjax.engine import steps as S

    req = _request(model, prefix_len=128, seed=7)
    engine = _engine(model, "spec", retention=0.25)
    engine.warm(req.prefix)
    events = []
    head_row = S.head_row
    monkeypatch.setattr(S, "head_row", lambda *a: events.append("first token") or head_row(*a))
    record = engine.speculator.usage.record
    monkeypatch.setattr(engine.speculator.usage, "record", lambda *a: events.append("record") or record(*a))
    p = engine.run(req).prefetch
    assert events[0] == "first token" and events.count("record") == model.config.num_layers
    assert p["prefetch_needed"] > 0 and p["prefetch_issued"] > 0


def _flip_a_chunk_byte(store_dir):
    chunk_files = sorted(p for p in store_dir.rglob("*") if p.is_file() and p.stat().st_size > 1024)
    victim = chunk_files[len(chunk_files) // 2]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


def test_corrupt_chunk_is_recomputed_not_served_and_stored_anew(model, tmp_path):
    """A chunk failing its checksum: the request is recomputed, and the prefix stored anew, so that the next request
    is served whole from the store and no chunk fails again."""
    from specjax.stores.fsck import fsck

    req = _request(model, prefix_len=64, seed=13)
    store = KVStore.open(tmp_path / "store", fingerprint(model, 16))
    engine = Engine(model, make_system("as_full"), store, EngineConfig(retention=1.0))
    engine.warm(req.prefix)
    _flip_a_chunk_byte(tmp_path / "store")
    r = engine.run(req)
    assert r.recomputed_bad_chunks and r.io["bad_chunks"] >= 1
    assert r.reused_tokens == 0
    np.testing.assert_allclose(r.first_token_logits, model.logits(req.prefix + req.query)[-1], atol=TOL, rtol=0)
    assert engine.repaired == [tuple(req.prefix)]
    again = engine.run(req)
    assert not again.recomputed_bad_chunks and again.io["bad_chunks"] == 0 and again.reused_tokens == 64
    np.testing.assert_allclose(again.first_token_logits, model.logits(req.prefix + req.query)[-1], atol=TOL, rtol=0)
    store.close()
    report = fsck(tmp_path / "store")
    assert report.ok and report.bad_chunks == 0 and report.chunks_checked > 0


def test_no_itf_reads_no_probe_key(model):
    """spec --no_itf identifies with H2O: it reads all keys and never a probe key it would not use."""
    req = _request(model, prefix_len=64, seed=4)
    engine = Engine(model, make_system("spec", no_itf=True), _store(model),
                    EngineConfig(retention=0.25, gpu_cache_bytes=0, cpu_cache_bytes=0))
    engine.warm(req.prefix)
    kinds = []
    read_runs = engine.store.read_runs

    def recording(layer, kind, chunks, **kw):
        kinds.append(kind)
        return read_runs(layer, kind, chunks, **kw)

    engine.store.read_runs = recording
    engine.run(req)
    assert K in kinds and V in kinds and PROBE not in kinds


@pytest.mark.parametrize("field, value", [("identify", "magic"), ("prefetch", "kv"), ("cache_policy", "mru")])
def test_unknown_policy_modes_are_refused_when_the_system_is_built(field, value):
    import dataclasses

    with pytest.raises(SpecjaxError, match=f"unknown {field} '{value}'"):
        dataclasses.replace(make_system("spec"), **{field: value})


def _locator(store, match):
    """`locate(layer, positions)` over one match, as the engine's LayerIO.locate (what speculation ranks with)."""
    return lambda layer, positions: store.locate(match, positions, layer)


def test_speculation_is_capped_by_what_the_disk_delivers_in_the_measured_window(model):
    """With a measured rate and window, spec speculates only the best-ranked chunks whose bytes fit; with none
    measured yet, the whole guess."""
    req = _request(model, prefix_len=96, seed=5)
    engine = Engine(model, make_system("spec"), _store(model), EngineConfig(retention=0.25))
    engine.warm(req.prefix)
    engine.run(req)
    speculator = engine.speculator
    assert speculator.window_s is not None and speculator.window_s > 0  # measured online
    match = engine.store.match(req.prefix)
    previous = np.arange(0, 96, 3)
    ranked, _ = speculation.ranking(_locator(engine.store, match), 2, previous)
    pair = sum(engine.store.layout.chunk_nbytes(kind) for kind in (K, V))
    assert len(ranked) >= 3
    assert list(speculator.within_budget(2, ranked, 2.5 * pair)) == list(ranked[:2])
    assert list(speculator.within_budget(2, ranked, math.inf)) == list(ranked)
    assert len(speculator.within_budget(2, ranked, 0)) == 0
    rate = engine.store.scheduler.rate_bytes_per_s()
    assert speculator.budget_bytes() == pytest.approx(rate * speculator.window_s, rel=0.05, abs=pair)
    speculator.window_s = None
    assert speculator.budget_bytes() == math.inf
    speculator.budget_bytes = lambda: 2.5 * pair  # what does not fit is read in the background, in rank order
    locate = _locator(engine.store, match)
    now, background = speculator.chunks(locate, 2, previous)
    likely = ranked[speculator.usage.likely(2, ranked)]
    assert len(now) == 2 and np.concatenate([now, background]).tolist() == likely.tolist()
    match.close()


def test_a_guess_is_made_only_while_its_bytes_take_the_disk_longer_than_it_costs_the_host(model):
    """Speculation measures what a guess costs the host and what a layer's selection reads from disk; where that
    selection arrives from the disk faster than a guess is made, layers read on demand, with the same answers, and
    the bytes and the rate go on being measured."""
    req = _request(model, prefix_len=96, seed=5)
    engine = Engine(model, make_system("spec"), _store(model),
                    EngineConfig(retention=0.25, gpu_cache_bytes=0, cpu_cache_bytes=0))
    engine.warm(req.prefix)
    speculator = engine.speculator
    assert speculator.pays()  # nothing measured yet: guess, as the paper does
    guessed = engine.run(req)
    rate = engine.store.scheduler.rate_bytes_per_s()
    assert rate and speculator.cost_s > 0 and speculator.selection_bytes > 0  # all measured by one request
    speculator.selection_bytes = 1e6
    speculator.cost_s = 0.5e6 / rate
    assert speculator.pays()
    speculator.cost_s = 2e6 / rate
    assert not speculator.pays()
    speculator.cost_s = math.inf  # no guess pays
    speculator.selection_bytes = -1.0
    handed = []  # what the request's thread hands to the I/O worker: its read plan, and no layer's guess
    submit = engine.io_worker.submit
    engine.io_worker.submit = lambda fn, *args: handed.append(fn.__name__) or submit(fn, *args)
    demand = engine.run(req)
    assert handed == ["_issue_plan"]
    assert guessed.prefetch["prefetch_issued"] > 0 and demand.prefetch["prefetch_issued"] == 0
    layers = model.config.num_layers - 1  # every layer but the last has a next one to guess, or not
    assert guessed.prefetch["prefetch_guessed_layers"] > 0
    assert guessed.prefetch["prefetch_guessed_layers"] + guessed.prefetch["prefetch_unpaid_layers"] == layers
    assert (demand.prefetch["prefetch_guessed_layers"], demand.prefetch["prefetch_unpaid_layers"]) == (0, layers)
    assert speculator.selection_bytes >= 0 and speculator.cost_s == math.inf  # still measured; no guess timed
    np.testing.assert_array_equal(demand.first_token_logits, guessed.first_token_logits)


def test_always_speculate_guesses_every_layer_whatever_a_guess_costs(model):
    """`--always_speculate` (SystemOptions.always_speculate): the paper's SPEC, a guess after every layer even where
    the measured rule says it would not pay; same answers; named so in results; refused beside no_prefetch."""
    req = _request(model, prefix_len=96, seed=5)
    system = make_system("spec", always_speculate=True)
    assert system.name == "spec-always_speculate" and system.prefetch.always
    assert make_system("as_h2o_lfu", always_speculate=True) == make_system("as_h2o_lfu")  # nothing to guess there
    with pytest.raises(SpecjaxError, match="contradict"):
        make_system("spec", always_speculate=True, no_prefetch=True)
    runs = {}
    for always in (False, True):
        engine = Engine(model, make_system("spec", always_speculate=always), _store(model),
                        EngineConfig(retention=0.25, gpu_cache_bytes=0, cpu_cache_bytes=0))
        engine.warm(req.prefix)
        engine.speculator.selection_bytes, engine.speculator.cost_s = 1.0, math.inf  # no guess pays
        runs[always] = engine.run(req)
    layers = model.config.num_layers - 1
    assert (runs[False].prefetch["prefetch_guessed_layers"], runs[False].prefetch["prefetch_unpaid_layers"]) == \
        (0, layers)
    assert (runs[True].prefetch["prefetch_guessed_layers"], runs[True].prefetch["prefetch_unpaid_layers"]) == \
        (layers, 0)
    assert runs[True].prefetch["prefetch_issued"] > 0 == runs[False].prefetch["prefetch_issued"]
    np.testing.assert_array_equal(runs[True].first_token_logits, runs[False].first_token_logits)


def test_chunk_usage_keeps_chunks_at_least_as_likely_needed_as_not():
    usage = speculation.ChunkUsage()
    assert usage.likely(3, [7]).tolist() == [True]  # never matched: read, as the paper's guess
    for needed in ([7], [], []):  # chunk 7 needed once in three requests; chunk 8 in all three
        usage.record(3, [7, 8], needed + [8])
    assert usage.counts(3, 7) == (3, 1) and usage.counts(3, 8) == (3, 3)
    assert usage.likely(3, [7, 8]).tolist() == [False, True]  # (1+1)/(3+2) < 1/2 <= (3+1)/(3+2)
    assert usage.likely(4, [7]).tolist() == [True]  # records are per layer
    usage.record(3, [7], [7])
    assert usage.likely(3, [7]).tolist() == [True]  # (2+1)/(4+2) = 1/2
    usage.forget([7])
    assert usage.counts(3, 7) == (0, 0) and usage.counts(3, 8) == (3, 3)


def test_spec_records_what_each_layer_needed_and_does_not_speculate_what_it_never_needs(model):
    """The engine records, per layer, the chunks each request matched and those its important set needed; a chunk
    the layer never needed across requests is left out of that layer's guess."""
    req = _request(model, prefix_len=96, seed=6)
    engine = Engine(model, make_system("spec"), _store(model),
                    EngineConfig(retention=0.25, gpu_cache_bytes=0, cpu_cache_bytes=0, trace=True))
    engine.warm(req.prefix)
    r = engine.run(req)
    store, usage = engine.store, engine.speculator.usage
    match = store.match(req.prefix)
    layer = model.config.num_layers - 1
    matched = store.locate(match, np.arange(match.length), layer).unique_chunks()
    needed = set(store.locate(match, np.unique(r.selections[layer]), layer).unique_chunks().tolist())
    assert [usage.counts(layer, int(c)) for c in matched] == [(1, int(c in needed)) for c in matched]
    previous = np.unique(r.selections[layer - 1])
    ranked, _ = speculation.ranking(_locator(store, match), layer, previous)
    dropped = int(ranked[0])  # the guess's best chunk, which this layer then needs in none of two more requests
    for _ in range(2):
        usage.record(layer, matched, [int(c) for c in matched if int(c) != dropped])
    engine.speculator.window_s = None  # no disk budget: only the records decide
    chosen, background = engine.speculator.chunks(_locator(store, match), layer, previous)
    chosen = chosen.tolist()
    assert dropped not in chosen and len(background) == 0
    likely = [int(c) for c in ranked if 2 * (usage.counts(layer, int(c))[1] + 1) >= usage.counts(layer, int(c))[0] + 2]
    assert chosen == likely and len(likely) == len(ranked) - 1  # the others were needed each time
    match.close()


def test_the_selection_event_shows_each_layers_set_and_guess_and_changes_nothing(model):
    """A measurement subscribes to `selection` (specjax.engine.events) instead of patching LayerIO: it sees every
    layer's chosen set while the speculation made for it is still there, and the request is the same."""
    from specjax.engine import events

    req = _request(model)
    engine = _engine(model, "spec", retention=0.25)
    engine.warm(req.prefix)
    seen = []

    def look(io, layer, chosen):
        seen.append((layer, np.array(chosen), layer in io.prefetched))

    with events.subscribed("selection", look):
        r = engine.run(req)
    assert not events.emit("selection", io=None, layer=0, chosen=None)  # unsubscribed after the block
    assert [layer for layer, _, _ in seen] == list(range(model.config.num_layers))
    for layer, chosen, _ in seen:
        np.testing.assert_array_equal(np.unique(chosen), np.unique(r.selections[layer]))
    assert any(guessed for _, _, guessed in seen[1:])  # the guess of a later layer is still held at the event
    again = engine.run(req)
    np.testing.assert_array_equal(again.first_token_logits, r.first_token_logits)
    with pytest.raises(ValueError, match="no engine event"):
        with events.subscribed("selected", look):
            pass


def test_every_system_returns_one_layer_record(model):
    """Every engine's per-layer record has the same fields (`LayerRecord`), read as a mapping."""
    from specjax.engine.types import LayerRecord

    req = _request(model)
    layers = model.config.num_layers
    for name in ("recompute", "as_full", "spec"):
        r = _run(model, name, req, retention=0.25)
        assert isinstance(r.layers, LayerRecord) and len(r.layers["retained"]) == layers
        assert set(r.layers) == {"prefix_tokens", "retained", "loaded_tokens", "recomputed", "fallback", "jaccard",
                                 "threshold", "head_share"}
        assert r.layers["recomputed"] == [1.0 if name == "recompute" else 0.0] * layers
    with pytest.raises(KeyError):
        r.layers["retention"]
    split = LayerRecord.split(layers, 100, 40)
    assert split["retained"] == [0.6] * layers and split["recomputed"] == [0.4] * layers
    assert split["loaded_tokens"] == [60] * layers
