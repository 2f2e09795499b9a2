"""ContiguousKV on the engine: whole 16-token chunks chosen per period, no read amplification, period prefetch."""

import math

import numpy as np
import pytest
import tensorstore as ts

import specjax
from specjax.engine import Engine, EngineConfig, Request, fingerprint, make_system
from specjax.engine import state as st
from specjax.errors import SpecjaxError
from specjax.stores import K, V, KVStore

TOL = 1e-4


@pytest.fixture(scope="module", params=["tiny-opt", "tiny-llama"])
def model(request):
    return specjax.load_model(request.param, init="random", seed=1)


def _request(model, prefix_len=96, query_len=7, seed=0):
    rng = np.random.default_rng(seed)
    v = model.config.vocab_size
    return Request(rng.integers(0, v, prefix_len).tolist(), rng.integers(0, v, query_len).tolist(),
                   [rng.integers(0, v, 3).tolist(), rng.integers(0, v, 6).tolist()])


def _engine(model, retention, cache_bytes=0, chunk_tokens=16, **sizes):
    spec = {"driver": "memory", "path": f"kv{np.random.randint(1 << 30)}/"}
    store = KVStore.open(spec, fingerprint(model, chunk_tokens), context=ts.Context())
    config = EngineConfig(retention=retention, gpu_cache_bytes=cache_bytes, cpu_cache_bytes=cache_bytes, trace=True)
    return Engine(model, make_system("contiguous_kv", **sizes), store, config)


def _run(engine, req):
    engine.warm(req.prefix)
    return engine.run(req)


def test_full_retention_equals_recompute(model):
    req = _request(model, prefix_len=90)  # a partial last chunk too
    r = _run(_engine(model, 1.0), req)
    ref = model.logits(req.prefix + req.query)[-1]
    np.testing.assert_allclose(r.first_token_logits, ref, atol=TOL, rtol=0)
    for (ours, _), cont in zip(r.continuation_logprobs, req.continuations):
        assert ours == pytest.approx(model.loglikelihood(req.prefix + req.query, cont)[0], abs=TOL)


@pytest.mark.parametrize("retention", [0.05, 0.25])
def test_reads_whole_chunks_and_nothing_more(model, retention):
    """One period (p = 8 > 2 layers): bytes read from disk are exactly the bytes of the tokens used."""
    req = _request(model, prefix_len=96)
    r = _run(_engine(model, retention), req)
    m, c = len(req.prefix), 16
    chunks = math.ceil(math.ceil(retention * m) / c)
    first = np.sort(r.selections[0][0])
    assert len(first) == chunks * c
    starts = first[::c]
    assert np.all(starts % c == 0) and np.array_equal(first, (starts[:, None] + np.arange(c)).reshape(-1))
    assert all(np.array_equal(np.sort(s[0]), first) for s in r.selections)  # the period shares one set
    assert r.io["disk_bytes"] == r.io["used_token_bytes"] > 0  # read amplification 1.0
    assert r.layers["retained"] == pytest.approx([chunks * c / m] * model.config.num_layers)


def test_chunks_are_the_best_scored_of_every_head(model):
    """The set equals the top chunks of the heads' normalised H2O scores summed per chunk (a numpy reference)."""
    rng = np.random.default_rng(3)
    scores = rng.random((4, 48)).astype(np.float32)
    state = st.ImportanceState.init(2, 48)
    _, positions, count, importance = st.chunk_select(state, 0, scores, 2, 45, chunk_tokens=16, chunk_cap=4,
                                                       k_cap=32)
    s = scores[:, :45] / scores[:, :45].sum(1, keepdims=True)
    per_chunk = np.add.reduceat(s.mean(0), [0, 16, 32])
    best = np.sort(np.argsort(-per_chunk)[:2])
    expected = np.concatenate([np.arange(b * 16, min(b * 16 + 16, 45)) for b in best])
    assert int(count) == len(expected)
    np.testing.assert_array_equal(np.asarray(positions)[: int(count)], expected)
    np.testing.assert_allclose(np.asarray(importance)[:45], s.mean(0), rtol=1e-5)


def test_each_period_chooses_again_and_prefetches_the_last_set(model):
    """p = 1: every layer is a period; the previous period's set is read ahead and scored as a speculation."""
    req = _request(model, prefix_len=128, seed=5)
    r = _run(_engine(model, 0.25, period_layers=1, subperiod_layers=1), req)
    p = r.prefetch
    assert p["prefetch_issued"] == 32 and p["prefetch_needed"] == 32  # layer 1 guessed layer 0's two chunks
    assert p["recall"] == pytest.approx(p["prefetch_used"] / 32)
    assert p["precision"] == pytest.approx(p["prefetch_used"] / max(p["prefetch_ahead"], 1))
    overlap = len(np.intersect1d(r.selections[0][0], r.selections[1][0]))
    assert p["prefetch_guess_hits"] == overlap and p["prefetch_used"] <= overlap
    # bytes beyond those used are only the V chunks read ahead for layer 1 and not chosen there
    v_chunk_bytes = 16 * model.config.num_kv_heads * model.config.head_dim * 4
    assert r.io["disk_bytes"] - r.io["used_token_bytes"] == (32 - overlap) // 16 * v_chunk_bytes


def test_attention_score_cache_credits_the_chosen_chunks(model):
    req = _request(model, prefix_len=96, seed=7)
    engine = _engine(model, 0.25, cache_bytes=1 << 20)
    first = _run(engine, req)
    chosen = set(engine.store.locate(engine.store.match(req.prefix), first.selections[0][0], 0).chunks.tolist())
    stats = engine.cache.stats
    assert all(stats[(0, V, c)].importance > 0 and stats[(0, K, c)].importance > 0 for c in chosen)
    others = {key for key in stats if key[:2] == (0, K) and key[2] not in chosen}
    assert others and all(stats[key].importance == 0 for key in others)  # keys read only to score
    second = engine.run(req)
    assert second.io["disk_bytes"] == 0 and second.io["device_hits"] > 0  # everything it needs stayed cached


def test_sizes_and_store_are_checked(model):
    assert (make_system("contiguous_kv").chunk_tokens, make_system("contiguous_kv").period_layers,
            make_system("contiguous_kv").subperiod_layers) == (16, 8, 4)
    s = make_system("contiguous_kv", ckv_chunk_tokens=32, period_layers=4, subperiod_layers=2)
    assert (s.name, s.chunk_tokens, s.period_layers, s.subperiod_layers) == ("contiguous_kv", 32, 4, 2)
    with pytest.raises(SpecjaxError, match="subperiod_layers"):
        make_system("contiguous_kv", period_layers=2, subperiod_layers=4)
    with pytest.raises(SpecjaxError, match="at least 1"):
        make_system("contiguous_kv", period_layers=0)
    with pytest.raises(SpecjaxError, match="16-token chunks but the store holds 64-token"):
        _engine(model, 0.25, chunk_tokens=64)
