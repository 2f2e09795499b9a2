"""cacheblend and full_reuse on a random 5-layer Llama with an in-memory store; the rag workload.

The precompute protocol (CacheBlend's reference): a context's first segment is stored whole, every later chunk's
KV is computed after the model's sink token (BOS) and only its own rows are read, re-rotated by (position in the
request - stored position)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

import specjax
from specjax.api import Model
from specjax.engine import BlendEngine, EngineConfig, Request, SystemOptions, fingerprint, make_system
from specjax.engine.blend import (CHECK_LAYER, blend_fingerprint, chunk_keys, chunk_sink, recompute_counts,
                                  reposition_keys)
from specjax.errors import SpecjaxError
from specjax.stores.errors import StoreMismatchError
from specjax.eval import synthetic, tasks, workload
from specjax.models import transformer as T
from specjax.models.params import init_params
from specjax.stores import K, KVStore

import toy_kv
from eval_fakes import FakeModel

TOL = 1e-4
SINK = 3  # the test model's BOS token id


@pytest.fixture(scope="module")
def model():
    """tiny-llama with 5 layers, so that several layers come after the check layer, and a BOS token (the sink)."""
    base = specjax.load_model("tiny-llama", init="random", seed=1)
    cfg = dataclasses.replace(base.config, num_layers=5, bos_token_id=SINK)
    return Model("tiny-llama-5", cfg, init_params(cfg, seed=1, dtype=jnp.float32), "random")


def _store(model, fp=None):
    spec = {"driver": "memory", "path": f"kv{np.random.randint(1 << 30)}/"}
    return KVStore.open(spec, blend_fingerprint(model, 16) if fp is None else fp, context=ts.Context())


def _engine(model, name, ratio=None, chunks=(), **blend):
    """An engine whose store holds `chunks` as one context's chunks (the first whole, the rest after the sink)."""
    config = EngineConfig(gpu_cache_bytes=64 << 10, cpu_cache_bytes=64 << 10, trace=True)
    engine = BlendEngine(model, make_system(name, blend_ratio=ratio, **blend), _store(model), config)
    for key in chunk_keys(chunks, engine.sink):
        engine.warm(key)
    return engine


def _request(model, lengths=(37, 50, 23), query_len=7, seed=0):
    rng = np.random.default_rng(seed)
    v = model.config.vocab_size
    chunks = [rng.integers(0, v, n).tolist() for n in lengths]
    return Request(sum(chunks, []), rng.integers(0, v, query_len).tolist(),
                   [rng.integers(0, v, 3).tolist(), rng.integers(0, v, 6).tolist()], chunks)


def _layer_keys(model, ids, start):
    """Keys of every layer of `ids` computed at positions start.. (nothing before them)."""
    cfg = model.config
    positions = jnp.arange(start, start + len(ids))
    h = T.embed(cfg, model.params, jnp.asarray(ids), positions)
    keys = []
    for lp in model.params["layers"]:
        h, k, _ = T.self_attention_layer(cfg, lp, h, positions, positions >= 0)
        keys.append(k)
    return keys


def test_sink_is_bos_else_eos_else_refused(model):
    assert chunk_sink(model.config) == (SINK,)
    assert chunk_sink(dataclasses.replace(model.config, bos_token_id=None, eos_token_id=7)) == (7,)
    none = Model("no-sink", dataclasses.replace(model.config, bos_token_id=None, eos_token_id=None), model.params,
                 "random")
    with pytest.raises(SpecjaxError, match="bos_token_id nor eos_token_id"):
        BlendEngine(none, make_system("cacheblend"), _store(model))


def test_rerotated_keys_equal_keys_of_the_sinked_chunk_at_the_new_position(model):
    """A later chunk's stored keys are [sink] + chunk computed from position 0, chunk rows (positions 1..len);
    rotated by (start - 1) they equal the chunk's keys when [sink] + chunk is computed with the sink at start - 1,
    the chunk at start.. (RoPE attention is relative, so only the rotation changes)."""
    first, chunk = _request(model).chunks[:2]
    engine = _engine(model, "full_reuse", chunks=[first, chunk])
    start = 173
    moved = _layer_keys(model, [SINK] + chunk, start - 1)
    with engine.store.match([SINK] + chunk) as match:
        assert match.length == len(chunk) + 1
        for layer in range(model.config.num_layers):
            stored = jnp.asarray(toy_kv.read(engine.store, match, layer, K).result().array)[:, 1:]
            shifted = reposition_keys(model.config, stored, jnp.full(len(chunk), start - 1, jnp.int32))
            np.testing.assert_allclose(shifted, moved[layer][:, 1:], atol=TOL, rtol=0)
            assert float(jnp.abs(stored - moved[layer][:, 1:]).max()) > 100 * TOL  # the rotation did something
            if layer > 0:  # layer 0 is position-free: the sink only changes the later layers
                alone = _layer_keys(model, chunk, start)[layer]
                assert float(jnp.abs(shifted - alone).max()) > 100 * TOL


def test_full_blend_ratio_equals_recompute(model):
    req = _request(model)
    r = _engine(model, "cacheblend", 1.0, req.chunks).run(req)
    np.testing.assert_allclose(r.first_token_logits, model.logits(req.prefix + req.query)[-1], atol=TOL, rtol=0)
    for (ours, greedy), cont in zip(r.continuation_logprobs, req.continuations):
        ref, ref_greedy = model.loglikelihood(req.prefix + req.query, cont)
        assert ours == pytest.approx(ref, abs=TOL) and greedy == ref_greedy
    assert r.io["disk_bytes"] == 0  # nothing reused, so nothing read


def test_a_blend_layers_reads_are_let_go_once_taken(model, held_behind):
    """A loaded layer's K/V reads are held only until the layer has taken them, not to the request's end."""
    req = _request(model)
    r = _engine(model, "cacheblend", 0.15, req.chunks).run(req)
    assert r.reused_tokens and not held_behind


def test_full_reuse_of_the_first_segment_alone_equals_recompute(model):
    """The first segment is stored whole (computed from position 0, no sink), as recompute computes it."""
    req = _request(model)
    chunk = req.chunks[0]
    engine = _engine(model, "full_reuse", chunks=[chunk])
    r = engine.run(Request(chunk, req.query, req.continuations, [chunk]))
    np.testing.assert_allclose(r.first_token_logits, model.logits(chunk + req.query)[-1], atol=TOL, rtol=0)
    for (ours, _), cont in zip(r.continuation_logprobs, req.continuations):
        assert ours == pytest.approx(model.loglikelihood(chunk + req.query, cont)[0], abs=TOL)
    assert r.reused_tokens == len(chunk) and r.computed_tokens == len(req.query)
    assert r.io["disk_bytes"] + r.io["device_hits"] + r.io["host_hits"] > 0


def test_full_reuse_after_a_sink_segment_equals_recompute(model):
    """A context [sink] + chunk as two chunks: the first segment is the sink itself (stored whole at position 0)
    and the chunk's KV is computed after the sink, so reusing both is exact (rotation 1 - 1 = 0); the same
    tokens are also stored whole under their own key (a first segment) without the two sharing KV."""
    req = _request(model)
    chunk = req.chunks[1]
    engine = _engine(model, "full_reuse", chunks=[chunk])  # chunk as a first segment: its own KV at 0..
    r = engine.run(Request([SINK] + chunk, req.query, req.continuations, [[SINK], chunk]))
    ref = model.logits([SINK] + chunk + req.query)[-1]
    np.testing.assert_allclose(r.first_token_logits, ref, atol=TOL, rtol=0)
    assert r.reused_tokens == len(chunk) + 1 and r.computed_tokens == len(req.query)
    for (ours, _), cont in zip(r.continuation_logprobs, req.continuations):
        assert ours == pytest.approx(model.loglikelihood([SINK] + chunk + req.query, cont)[0], abs=TOL)
    again = engine.run(Request(chunk, req.query, req.continuations, [chunk]))  # the whole-stored entry
    np.testing.assert_allclose(again.first_token_logits, model.logits(chunk + req.query)[-1], atol=TOL, rtol=0)


def test_store_without_the_sink_protocol_is_refused(model, tmp_path):
    with pytest.raises(SpecjaxError, match="chunk_sink"):
        BlendEngine(model, make_system("cacheblend"), _store(model, fingerprint(model, 16)))
    old = KVStore.open(str(tmp_path / "old"), fingerprint(model, 16))  # written with the earlier protocol
    old.close()
    with pytest.raises(StoreMismatchError, match="chunk_sink"):
        KVStore.open(str(tmp_path / "old"), blend_fingerprint(model, 16))


def test_full_reuse_of_later_chunks_misses_cross_attention(model):
    req = _request(model)
    r = _engine(model, "full_reuse", chunks=req.chunks).run(req)
    assert np.abs(r.first_token_logits - model.logits(req.prefix + req.query)[-1]).max() > 1e-3
    assert all(len(s) == 0 for s in r.selections)


_project = jax.jit(T.project, static_argnums=0)
_attend_and_mlp = jax.jit(T.attend_and_mlp, static_argnums=0)


def _blend_reference(model, req, ratio, deviation="value", filtering="gradual"):
    """CacheBlend written out plainly: the first chunk's KV computed alone, every later chunk's computed after
    the sink (its own rows kept), re-rotated to the chunk's place; every token on layers 0..CHECK_LAYER, then
    per layer the previous set's tokens with the largest value (key, key + value) deviation."""
    cfg, params = model.config, model.params
    m, n = len(req.prefix), len(req.query)
    reused_k, reused_v, start = [[] for _ in params["layers"]], [[] for _ in params["layers"]], 0
    for i, chunk in enumerate(req.chunks):
        ids = chunk if i == 0 else [SINK] + chunk
        skip = len(ids) - len(chunk)
        positions = jnp.arange(len(ids))
        h = T.embed(cfg, params, jnp.asarray(ids), positions)
        for layer, lp in enumerate(params["layers"]):
            h, k, v = T.self_attention_layer(cfg, lp, h, positions, positions >= 0)
            reused_k[layer].append(T.rope(k[:, skip:], jnp.full(len(chunk), start - skip), cfg.rope_theta))
            reused_v[layer].append(v[:, skip:])
        start += len(chunk)
    counts = recompute_counts(cfg.num_layers, m, ratio, filtering=filtering)
    tokens = np.asarray(req.prefix + req.query)
    chosen = np.arange(m)
    rows = np.arange(m + n)
    h = T.embed(cfg, params, jnp.asarray(tokens), jnp.asarray(rows))
    sets = []
    for layer, lp in enumerate(params["layers"]):
        sets.append(chosen)
        old_k = jnp.concatenate(reused_k[layer], axis=1)
        old_v = jnp.concatenate(reused_v[layer], axis=1)
        q, k, v = _project(cfg, lp, h, jnp.asarray(rows))
        keys = jnp.concatenate([old_k, jnp.zeros((cfg.num_kv_heads, n, cfg.head_dim))], axis=1).at[:, rows].set(k)
        values = jnp.concatenate([old_v, jnp.zeros((cfg.num_kv_heads, n, cfg.head_dim))], axis=1).at[:, rows].set(v)
        h = _attend_and_mlp(cfg, lp, h, q, keys, values, jnp.asarray(rows), jnp.arange(m + n))
        if layer + 1 < cfg.num_layers and counts[layer + 1] < len(chosen):
            value_dev = np.asarray(((v[:, : len(chosen)] - old_v[:, chosen]) ** 2).sum((0, 2)))
            key_dev = np.asarray(((k[:, : len(chosen)] - old_k[:, chosen]) ** 2).sum((0, 2)))
            score = {"value": value_dev, "key": key_dev, "key_value": value_dev + key_dev}[deviation]
            keep = np.sort(np.argsort(-score, kind="stable")[: counts[layer + 1]])
            chosen = chosen[keep]
            index = np.concatenate([keep, np.arange(len(rows) - n, len(rows))])
            rows, h = rows[index], h[index]
    return sets, np.asarray(T.head(cfg, params, h[-1:]))[0]


@pytest.mark.parametrize("ratio,deviation,filtering", [(0.15, "value", "gradual"), (0.5, "value", "gradual"),
                                                      (0.3, "key", "fixed"), (0.3, "key_value", "gradual")])
def test_selection_is_the_top_deviation_subset_of_the_previous_set(model, ratio, deviation, filtering):
    req = _request(model)
    r = _engine(model, "cacheblend", ratio, req.chunks, blend_deviation=deviation, blend_filter=filtering).run(req)
    sets, logits = _blend_reference(model, req, ratio, deviation, filtering)
    counts = recompute_counts(model.config.num_layers, len(req.prefix), ratio, filtering=filtering)
    assert [len(s) for s in r.selections] == counts
    assert counts[:CHECK_LAYER + 1] == [len(req.prefix)] * (CHECK_LAYER + 1)
    if filtering == "gradual":
        assert counts[-1] < counts[CHECK_LAYER + 1]
    else:
        assert counts[CHECK_LAYER + 1:] == [math.ceil(ratio * len(req.prefix))] * len(counts[CHECK_LAYER + 1:])
    for layer, (ours, ref) in enumerate(zip(r.selections, sets)):
        np.testing.assert_array_equal(ours, ref, err_msg=f"layer {layer}")
        if layer > CHECK_LAYER + 1:
            assert set(ours) <= set(r.selections[layer - 1])
    np.testing.assert_allclose(r.first_token_logits, logits, atol=TOL, rtol=0)


def test_deviations_choose_different_tokens(model):
    """The three deviations are different rankings (else the setting would be a no-op)."""
    req = _request(model)
    chosen = {d: _engine(model, "cacheblend", 0.3, req.chunks, blend_deviation=d).run(req).selections[CHECK_LAYER + 1]
              for d in ("value", "key", "key_value")}
    assert not np.array_equal(chosen["value"], chosen["key"])


def test_a_blend_layer_subscriber_may_rank_by_its_own_deviation(model):
    """`blend_layer` (specjax.engine.events): an oracle's deviation replaces the built one in the ranking; here one
    that ranks later tokens first, so the first filtered layer recomputes the prefix's last tokens."""
    from specjax.engine import events

    req = _request(model)
    m = len(req.prefix)
    counts = recompute_counts(model.config.num_layers, m, 0.3, filtering="gradual")
    built = _engine(model, "cacheblend", 0.3, req.chunks).run(req).selections[CHECK_LAYER + 1]
    with events.subscribed("blend_layer", lambda rows, **_: rows.astype(jnp.float32)):
        later = _engine(model, "cacheblend", 0.3, req.chunks).run(req)
    np.testing.assert_array_equal(later.selections[CHECK_LAYER + 1], np.arange(m - counts[CHECK_LAYER + 1], m))
    assert not np.array_equal(built, later.selections[CHECK_LAYER + 1])
    assert later.layers["recomputed"][CHECK_LAYER + 1] == counts[CHECK_LAYER + 1] / m


def test_bad_blend_settings_are_refused():
    with pytest.raises(SpecjaxError, match="unknown blend_deviation 'values'"):
        make_system("cacheblend", blend_deviation="values")
    with pytest.raises(SpecjaxError, match="choose one of gradual, fixed"):
        make_system("cacheblend", blend_filter="layerwise")


def test_recompute_counts_schedule():
    assert recompute_counts(30, 600, 0.0) == [0] * 30
    assert recompute_counts(30, 600, 1.0) == [600] * 30
    counts = recompute_counts(30, 600, 0.15)
    later = counts[CHECK_LAYER + 1:]
    assert counts[:CHECK_LAYER + 1] == [600] * (CHECK_LAYER + 1)
    assert all(a >= b for a, b in zip(later, later[1:]))
    assert np.mean(later) == pytest.approx(0.15 * 600, rel=0.02)
    assert later[0] > 0.15 * 600 > later[-1]


def test_opt_is_refused_with_a_clear_error():
    opt = specjax.load_model("tiny-opt", init="random", seed=1)
    for name in ("cacheblend", "full_reuse"):
        with pytest.raises(SpecjaxError, match="RoPE"):
            BlendEngine(opt, make_system(name), _store(opt, fingerprint(opt, 16)))


def test_chunks_must_concatenate_to_the_prefix(model):
    req = _request(model)
    with pytest.raises(SpecjaxError, match="concatenate"):
        _engine(model, "full_reuse").run(dataclasses.replace(req, chunks=req.chunks[:2]))


def test_missing_chunk_is_computed_and_stored(model):
    req = _request(model)
    engine = _engine(model, "full_reuse", chunks=req.chunks[:1])
    first = engine.run(req)
    assert first.io["disk_bytes_written"] > 0
    again = engine.run(req)
    assert again.io["disk_bytes_written"] == 0
    np.testing.assert_allclose(again.first_token_logits, first.first_token_logits, atol=TOL, rtol=0)


# ---- the rag workload ----------------------------------------------------------------------------

TOKENIZER = FakeModel().tokenizer


def _rag(seed=0, limit=30):
    spec = workload.WorkloadSpec(limit=limit, seed=seed)
    return workload.build_workload(tasks.load_task("rag"), TOKENIZER, spec)


def test_rag_workload_is_deterministic_and_prefix_is_the_chunks():
    a, b, c = _rag(0), _rag(0), _rag(1)
    assert a == b and a.requests != c.requests
    orders = set()
    for r in a.requests:
        assert r.prefix_ids == sum(r.chunk_ids, ())
        assert 5 <= len(r.chunk_ids) <= 7  # the header chunk + 4-6 retrieved chunks
        assert r.chunk_ids[0] == tuple(TOKENIZER.encode(synthetic.RAG_HEADER))
        orders.add(r.chunk_ids)
        text = TOKENIZER.decode(list(r.prefix_ids))
        question = TOKENIZER.decode(list(r.query_ids))
        key = question.split("The secret code of ")[1].removesuffix(" is")
        assert f"The secret code of {key} is {r.choices[r.gold]}." in text
        for i, choice in enumerate(r.choices):
            assert (f" is {choice}." in text) and (i == r.gold or f"{key} is {choice}." not in text)
    assert len(orders) > 1 and len({len(r.chunk_ids) for r in a.requests}) > 1
    pool = {c for r in a.requests for c in r.chunk_ids[1:]}
    assert len(pool) <= synthetic.RagSpec.pool_chunks
    for chunk in pool:  # every chunk is a needle body tokenized on its own
        assert TOKENIZER.decode(list(chunk)).endswith("\n")


def test_rag_runs_through_the_eval_runner(tmp_path):
    from specjax.eval import runner, systems as systems_lib

    base = specjax.load_model("tiny-llama", init="random", seed=1)
    base = Model(base.name, dataclasses.replace(base.config, bos_token_id=SINK), base.params, "random")
    wl = _rag(limit=3)
    # the random model's vocabulary is smaller than the fake tokenizer's: fold the ids into it
    fold = lambda ids: tuple(int(t) % base.config.vocab_size for t in ids)
    requests = tuple(dataclasses.replace(r, prefix_ids=fold(r.prefix_ids), query_ids=fold(r.query_ids),
                                         choice_ids=tuple(fold(c) for c in r.choice_ids),
                                         chunk_ids=tuple(fold(c) for c in r.chunk_ids)) for r in wl.requests)
    wl = dataclasses.replace(wl, requests=requests)
    settings = systems_lib.SystemSettings(EngineConfig(gpu_cache_bytes=1 << 20, cpu_cache_bytes=1 << 20),
                                          options=SystemOptions(blend_ratio=1.0))
    names = ["recompute", "full_reuse", "cacheblend", "as_full"]  # a prefix system runs on rag too
    runs = runner.run_all(base, wl, runner.plan(names, [0.25]), settings, tmp_path)
    by_name = {run.system: run for run in runs}
    assert [run.retention for run in runs] == [None] * 4
    for a, b in zip(by_name["recompute"].outcomes, by_name["cacheblend"].outcomes):
        np.testing.assert_allclose(a.choice_logprobs, b.choice_logprobs, atol=1e-3, rtol=0)
    reuse = by_name["full_reuse"].outcomes[0]
    assert reuse.counters["reused_tokens"] == len(requests[0].prefix_ids)
    assert reuse.counters["disk_bytes"] + reuse.counters["device_hits"] + reuse.counters["host_hits"] > 0
    assert by_name["cacheblend"].outcomes[0].layers["recomputed"] == [1.0] * base.config.num_layers
    for a, b in zip(by_name["recompute"].outcomes, by_name["as_full"].outcomes):  # whole contexts stored
        np.testing.assert_allclose(a.choice_logprobs, b.choice_logprobs, atol=1e-3, rtol=0)


def test_eval_options_reach_the_system():
    from specjax.eval import registry, systems as systems_lib

    model = specjax.load_model("tiny-llama", init="random", seed=1)
    settings = systems_lib.SystemSettings(
        options=SystemOptions(blend_ratio=0.3, blend_deviation="key", blend_filter="fixed"))
    system = registry.make_system("cacheblend", model, settings).system
    assert (system.schedule.ratio, system.schedule.deviation, system.schedule.filter) == (0.3, "key", "fixed")
