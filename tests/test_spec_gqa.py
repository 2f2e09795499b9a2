"""spec_gqa: ITF with KV-head probes and candidates from per-chunk key summaries; the summaries (store) and
Quest's chunk bounds (kernels.quest) it rests on."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

import specjax
from specjax.engine import Engine, EngineConfig, SystemOptions, fingerprint, make_system
from specjax.errors import SpecjaxError
from specjax.kernels import quest
from specjax.stores import K, PROBE, KVStore
from specjax.stores.summaries import summarise

from test_engine import _request
from test_stores_store import FP, _chunk_file, _flip_bit, _stored_prefix, random_kv


# ---------------------------------------------------------------- Quest's bounds


def test_chunk_bounds_bound_every_key_and_are_tight_for_one_key():
    rng = np.random.default_rng(0)
    H, G, n, d, C, c = 4, 2, 5, 8, 6, 7
    q = rng.standard_normal((H, n, d)).astype(np.float32)
    keys = rng.standard_normal((C, G, c, d)).astype(np.float32)
    summaries = np.stack([summarise(keys[i]) for i in range(C)])  # [C, G, 2, d]
    kv_of_head = (0, 0, 1, 1)
    bounds = np.asarray(quest.chunk_bounds(jnp.asarray(q), jnp.asarray(summaries), kv_of_head=kv_of_head))
    exact = np.einsum("hnd,cgtd->hncgt", q, keys)[:, :, :, list(kv_of_head)] / math.sqrt(d)
    best = np.stack([exact[h, :, :, h] for h in range(H)]).max(-1)  # [H, n, C]: each chunk's best key
    assert np.all(bounds >= best - 1e-5)
    one = np.stack([summarise(keys[i][:, :1]) for i in range(C)])  # a chunk of one key: the bound is its score
    bounds_one = np.asarray(quest.chunk_bounds(jnp.asarray(q), jnp.asarray(one), kv_of_head=kv_of_head))
    np.testing.assert_allclose(bounds_one, np.stack([exact[h, :, :, h, 0] for h in range(H)]), atol=1e-5)


def test_chunk_mass_is_a_softmax_over_valid_chunks_summed_over_valid_queries():
    rng = np.random.default_rng(1)
    H, n, d, C = 2, 6, 4, 5
    q = rng.standard_normal((H, n, d)).astype(np.float32)
    summaries = rng.standard_normal((C, 1, 2, d)).astype(np.float32)
    summaries.sort(axis=2)  # min <= max
    mass = np.asarray(quest.chunk_mass(jnp.asarray(q), jnp.asarray(summaries), 4, 3, kv_of_head=(0, 0)))
    bounds = np.asarray(quest.chunk_bounds(jnp.asarray(q), jnp.asarray(summaries), kv_of_head=(0, 0)))[:, :4, :3]
    p = np.exp(bounds - bounds.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)).sum(1)
    np.testing.assert_allclose(mass[:, :3], want / want.sum(-1, keepdims=True), atol=1e-6)
    assert np.all(mass[:, 3:] == 0)


# ---------------------------------------------------------------- key summaries in the store


def test_key_summaries_come_from_writes_and_else_from_verified_reads(tmp_path):
    rng = np.random.default_rng(5)
    fp = dict(FP, chunk_tokens=16)
    tokens, kv, root = rng.integers(0, 1000, 48), random_kv(rng, 48), str(tmp_path / "s")
    want = np.stack([summarise(kv[1][K][:, 16 * j:16 * (j + 1)]) for j in range(3)])
    with KVStore.open(root, fp) as store:
        store.insert(tokens, kv)
        with store.match(tokens) as m:
            chunks = np.unique(store.locate(m, np.arange(48), 1).chunks)
        got = store.key_summaries(1, chunks)  # filed by the writer: nothing is read
        assert store.metrics.disk_bytes == 0 and got.ok.all()
        np.testing.assert_array_equal(got.array, want)
    with KVStore.open(root, fp) as store:  # another handle: read once, verified
        got = store.key_summaries(1, chunks)
        assert store.metrics.disk_bytes == 3 * kv[1][K][:, :16].nbytes and got.ok.all()
        np.testing.assert_array_equal(got.array, want)
        again = store.key_summaries(1, chunks[::-1])
        assert store.metrics.disk_bytes == 3 * kv[1][K][:, :16].nbytes  # nothing read the second time
        np.testing.assert_array_equal(again.array, want[::-1])
    _flip_bit(_chunk_file(root, 2, K, 1), 3, 0x04)
    with KVStore.open(root, fp) as store:
        got = store.key_summaries(2, chunks)
        assert got.ok.tolist() == [True, False, True] and not got.array[1].any()


def test_a_summary_is_never_served_for_other_keys_under_the_same_chunk_id(tmp_path):
    """Summaries are filed under their chunk's checksums: a chunk id that holds other keys finds none."""
    root, fp, tokens, kv = _stored_prefix(tmp_path, 6)
    with KVStore.open(root, fp) as store:
        with store.match(tokens) as m:
            chunk = int(store.locate(m, [0], 0).chunks[0])
        other = kv[0][K][:, :16] + 1.0
        store.summaries.put(0, chunk, (1, 2), other)  # as if the id had once held other keys
        got = store.key_summaries(0, [chunk])
        np.testing.assert_array_equal(got.array[0], summarise(kv[0][K][:, :16]))


# ---------------------------------------------------------------- the system


@pytest.fixture(scope="module", params=["tiny-opt", "tiny-llama", "tiny-gqa"])
def model(request):
    return specjax.load_model(request.param, init="random", seed=1)


def _engine(model, system, retention, store=None):
    store = store or KVStore.open({"driver": "memory", "path": f"kv{np.random.randint(1 << 30)}/"},
                                  fingerprint(model, 16), context=ts.Context())
    return Engine(model, system, store, EngineConfig(retention=retention, gpu_cache_bytes=0, cpu_cache_bytes=0,
                                                     trace=True))


def _record_reads(engine) -> list:
    """From now on, every store read of the engine as (layer, kind, chunks), in a list returned."""
    reads = []
    read_runs = engine.store.read_runs

    def recording(layer, kind, chunks, **kw):
        reads.append((layer, kind, list(chunks)))
        return read_runs(layer, kind, chunks, **kw)

    engine.store.read_runs = recording
    return reads


def _run(engine, req):
    engine.warm(req.prefix)
    engine.store.metrics.reset()
    return engine.run(req)


@pytest.mark.parametrize("retention, candidates, alpha", [(0.25, None, 0.8), (0.5, 2.0, 1.0)])
def test_with_one_query_head_per_kv_head_it_selects_what_spec_selects(retention, candidates, alpha):
    """tiny-opt (4 query heads on 4 KV heads): when every position is a candidate (no candidate stage, or B x k
    covering the prefix) spec_gqa's probe KV heads are spec's probe heads, and it selects and computes the same.
    alpha is chosen so that one layer shares a set and the other falls back."""
    model = specjax.load_model("tiny-opt", init="random", seed=1)
    assert model.config.q_per_kv == 1
    req = _request(model, prefix_len=160, seed=3)
    spec = _run(_engine(model, make_system("spec", alpha=alpha), retention), req)
    gqa = _run(_engine(model, dataclasses.replace(make_system("spec_gqa"), candidates=candidates, alpha=alpha),
                       retention), req)
    assert any(spec.layers["fallback"]) and not all(spec.layers["fallback"])  # both paths are compared
    assert spec.layers["fallback"] == gqa.layers["fallback"]
    for layer, (a, b) in enumerate(zip(spec.selections, gqa.selections)):
        np.testing.assert_array_equal(np.sort(a, -1), np.sort(b, -1), err_msg=f"layer {layer}")
    np.testing.assert_array_equal(spec.first_token_logits, gqa.first_token_logits)
    assert gqa.io["disk_bytes"] == spec.io["disk_bytes"]


def test_only_candidate_chunks_are_read_and_selections_lie_in_them(model):
    """At 25% with B = 2 on a 160-token prefix in 16-token chunks, a layer reads the key summaries it lacks
    (none: this handle wrote them), then only candidate chunks, at least 2k positions of whole chunks; every
    selected position lies in them."""
    req = _request(model, prefix_len=160, seed=3)
    engine = _engine(model, make_system("spec_gqa", gqa_candidates=2), 0.25)
    engine.warm(req.prefix)
    reads = _record_reads(engine)
    r = engine.run(req)
    k = math.ceil(0.25 * 160)
    # tiny-opt: its probe kind holds 3 of its 4 KV heads, the probe KV heads; tiny-llama: both of its 2; tiny-gqa:
    # the probe kind holds KV heads 0 and 1 (query heads 0-2), the probe KV heads are 0-2, read from K
    probe_kind = engine.identification.probe_source(engine.facts)
    assert probe_kind == (K if model.config.num_kv_heads == 4 and model.config.q_per_kv == 2 else PROBE)
    with engine.store.match(req.prefix) as m:
        for layer, chosen in enumerate(r.selections):
            chunk_of = engine.store.locate(m, np.arange(160), layer).chunks
            read = {c for lay, kind, chunks in reads if lay == layer and kind == probe_kind for c in chunks}
            assert read and len(read) < len(set(chunk_of))  # some chunks never read
            candidates = np.isin(chunk_of, list(read))
            assert candidates.sum() >= 2 * k
            assert candidates[np.unique(chosen)].all()
    assert r.io["disk_bytes"] < _run(_engine(model, make_system("as_h2o_lfu"), 0.25), req).io["disk_bytes"]


def test_full_retention_equals_recompute(model):
    req = _request(model)
    base = _run(_engine(model, make_system("as_full"), 1.0), req)
    r = _run(_engine(model, make_system("spec_gqa"), 1.0), req)
    np.testing.assert_allclose(r.first_token_logits, base.first_token_logits, atol=1e-5, rtol=0)
    np.testing.assert_allclose([c for c, _ in r.continuation_logprobs],
                               [c for c, _ in base.continuation_logprobs], atol=1e-5, rtol=0)


def test_a_candidate_budget_below_the_kept_tokens_or_a_head_share_outside_0_1_is_refused():
    with pytest.raises(SpecjaxError, match="candidates must be at least 1"):
        dataclasses.replace(make_system("spec_gqa"), candidates=0.5)
    for bad in (0.0, 1.5):
        with pytest.raises(SpecjaxError, match="min_head_share must be in"):
            dataclasses.replace(make_system("spec_gqa"), min_head_share=bad)
    assert dataclasses.replace(make_system("spec_gqa"), min_head_share=1.0).min_head_share == 1.0


def test_the_candidate_stage_is_a_setting_and_off_by_default():
    """make_system / the eval's --gqa_candidates: B turns the candidate stage on with budget B x k (the System's
    name says so), 0 or nothing leaves spec_gqa as it is, without one, and every chunk's probe keys are read; other
    systems ignore it."""
    from specjax.eval.engine_systems import EngineSystem
    from specjax.eval.systems import SystemSettings

    assert make_system("spec_gqa").candidates is None
    assert make_system("spec_gqa", gqa_candidates=0) == make_system("spec_gqa")
    wide = make_system("spec_gqa", gqa_candidates=3)
    assert (wide.name, wide.candidates) == ("spec_gqa-candidates3", 3.0)
    with pytest.raises(SpecjaxError, match="gqa_candidates must be 0 .* or at least 1"):
        make_system("spec_gqa", gqa_candidates=0.5)
    assert make_system("spec", gqa_candidates=2) == make_system("spec")
    model = specjax.load_model("tiny-gqa", init="random", seed=1)
    on = EngineSystem("spec_gqa", model, SystemSettings(options=SystemOptions(gqa_candidates=2))).system
    assert (on.name, on.candidates) == ("spec_gqa-candidates2", 2.0)
    off = EngineSystem("spec_gqa", model, SystemSettings()).system
    assert (off.name, off.candidates) == ("spec_gqa", None)

    req = _request(model, prefix_len=160, seed=3)
    engine = _engine(model, off, 0.25)
    engine.warm(req.prefix)
    reads = _record_reads(engine)
    engine.run(req)
    probe_kind = engine.identification.probe_source(engine.facts)
    with engine.store.match(req.prefix) as m:
        for layer in range(model.config.num_layers):
            every = set(engine.store.locate(m, np.arange(160), layer).chunks.tolist())
            assert {c for lay, kind, chunks in reads if lay == layer and kind == probe_kind for c in chunks} == every


def test_kv_head_scores_give_every_query_head_one_vote():
    from specjax.engine import state as st

    scores = np.array([[1, 3, 0, 9], [2, 2, 0, 9], [5, 0, 5, 9], [1, 1, 2, 9]], np.float32)  # column 3: padding
    got = np.asarray(st.kv_head_scores(jnp.asarray(scores), 3, groups=2))
    valid = scores[:, :3] / scores[:, :3].sum(1, keepdims=True)
    np.testing.assert_allclose(got[:, :3], [valid[0] + valid[1], valid[2] + valid[3]], rtol=1e-6)
    assert np.all(got[:, 3] == 0)
    np.testing.assert_array_equal(np.asarray(st.kv_head_scores(jnp.asarray(scores), 3, groups=4)), scores)


def test_head_share_is_the_worst_heads_share_of_its_own_top_k_attention():
    from specjax.kernels import itf

    rng = np.random.default_rng(0)
    H, m, m_pad, k, k_cap = 5, 13, 16, 4, 8
    scores = rng.random((H, m_pad)).astype(np.float32)
    scores[:, m:] = 100.0  # padding: never anyone's top-k
    shared = np.array([3, 7, 0, 12, 9, 1, 15, 14], np.int32)  # entries past k do not count
    own = np.sort(scores[:, :m], axis=1)[:, ::-1][:, :k].sum(1)
    want = (scores[:, shared[:k]].sum(1) / own).min()
    got = float(itf.head_share(jnp.asarray(scores), jnp.asarray(shared), k, m, k_cap=k_cap))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    best = np.argsort(-scores[0, :m])[:k_cap].astype(np.int32)  # every head scoring alike: its own set keeps all
    same = np.broadcast_to(scores[:1], (H, m_pad))
    assert float(itf.head_share(jnp.asarray(same), jnp.asarray(best), k, m, k_cap=k_cap)) == pytest.approx(1.0)


@pytest.mark.parametrize("guarded", [True, False])
def test_the_one_step_decision_equals_the_steps_it_fuses(guarded):
    """`state.gqa_select` (one dispatch per layer) gives the state and sets of kv_head_scores -> itf_select ->
    guard_shared -> per_head_select (its per-head sets on a layer that falls back, where they are used), on layers
    whose probes agree, whose guard fails, and whose probes disagree."""
    from specjax.engine import state as st

    rng = np.random.default_rng(1)
    H, groups, probe_rows, m, m_pad, k, k_cap = 6, 2, 4, 40, 48, 8, 16
    base = rng.random(m_pad).astype(np.float32)
    layers = [np.tile(base, (H, 1)) + 0.01 * rng.random((H, m_pad), np.float32),  # agree: shared
              rng.random((H, m_pad)).astype(np.float32) ** 8]  # disagree: fallback
    outcomes = set()
    for min_share in (0.5, 0.999):
        for alpha in (0.6, 0.0):
            seq = fused = st.ImportanceState.init(len(layers), m_pad)
            for layer, scores in enumerate(layers):
                every = jnp.asarray(scores)
                probes = st.kv_head_scores(every[:probe_rows], m, groups=groups)
                seq, shared, use = st.itf_select(seq, layer, probes, k, m, alpha, k_cap=k_cap, kept_of=m)
                if guarded:
                    seq, use = st.guard_shared(seq, layer, every, shared, k, m, use, min_share, k_cap=k_cap)
                _, per_head = st.per_head_select(seq, layer, every, k, m, k_cap=k_cap, kept_of=m)
                fused, f_probes, f_shared, f_per_head, f_use = st.gqa_select(
                    fused, layer, every, k, m, alpha, min_share, groups=groups, probe_rows=probe_rows, k_cap=k_cap,
                    guarded=guarded, kept_of=m)
                assert bool(f_use) == bool(use)
                outcomes.add(bool(use))
                np.testing.assert_array_equal(np.asarray(f_probes), np.asarray(probes))
                np.testing.assert_array_equal(np.asarray(f_shared)[:k], np.asarray(shared)[:k])
                if not bool(use):
                    np.testing.assert_array_equal(np.asarray(f_per_head)[:, :k], np.asarray(per_head)[:, :k])
            for field in ("selected", "count", "jaccard", "threshold", "head_share", "fallback", "retained"):
                np.testing.assert_array_equal(np.asarray(getattr(fused, field)), np.asarray(getattr(seq, field)),
                                              err_msg=field)
    assert outcomes == {True, False}  # both branches were exercised


def test_on_a_grouped_query_model_a_shared_set_must_keep_every_heads_share():
    """tiny-gqa (2 query heads per KV head): every layer records the shared set's least head share, and shares its
    set exactly when the probes' Jaccard passes and that share reaches min_head_share; a threshold above layer 0's
    share sends layer 0 to per-head sets. A threshold nothing fails is SPEC's test alone; on an MHA model there is no
    guard (its share is not measured)."""
    model = specjax.load_model("tiny-gqa", init="random", seed=1)
    assert model.config.q_per_kv > 1
    req = _request(model, prefix_len=160, seed=3)

    def run(min_share, m=model):
        system = dataclasses.replace(make_system("spec_gqa"), min_head_share=min_share, alpha=2.0)  # Jaccard passes
        return _run(_engine(m, system, 0.25), req if m is model else _request(m, prefix_len=160, seed=3))

    plain, loose = run(None), run(1e-6)
    share = np.asarray(loose.layers["head_share"])
    assert np.all((share > 0) & (share <= 1)) and np.isnan(plain.layers["head_share"]).all()
    assert not any(loose.layers["fallback"]) and loose.layers["fallback"] == plain.layers["fallback"]
    np.testing.assert_array_equal(loose.first_token_logits, plain.first_token_logits)
    strict = run(float(share[0]) + 1e-3)
    assert strict.layers["jaccard"][0] >= strict.layers["threshold"][0]  # layer 0 as in `loose`: the guard decides
    assert strict.layers["fallback"][0] and np.shape(strict.selections[0])[0] == model.config.num_heads
    s, fell = np.asarray(strict.layers["head_share"]), np.asarray(strict.layers["fallback"])
    jaccard_fails = np.asarray(strict.layers["jaccard"]) < np.asarray(strict.layers["threshold"])
    np.testing.assert_array_equal(fell, jaccard_fails | (s < float(share[0]) + 1e-3))
    for layer in np.flatnonzero(~fell):
        assert np.shape(strict.selections[layer])[0] == 1  # one set for every head
    mha = run(0.99, specjax.load_model("tiny-opt", init="random", seed=1))
    assert np.isnan(mha.layers["head_share"]).all()


def test_the_host_tier_gives_the_key_summaries_their_bytes():
    """Summaries live in host memory: with its candidate stage spec_gqa's host cache budget is --cpu_cache less
    their bytes (1/16 of K at 16-token chunks); other systems keep the whole budget."""

    model = specjax.load_model("tiny-llama", init="random", seed=1)
    req = _request(model, prefix_len=160, seed=3)
    store = KVStore.open({"driver": "memory", "path": f"kv{np.random.randint(1 << 30)}/"}, fingerprint(model, 16),
                         context=ts.Context())
    Engine(model, make_system("as_full"), store, EngineConfig()).warm(req.prefix)
    lay = store.layout
    assert store.summary_bytes == 10 * lay.num_layers * lay.kv_heads * 2 * lay.head_dim * 4  # 10 chunks
    config = EngineConfig(cpu_cache_bytes=1 << 20)
    assert Engine(model, make_system("spec_gqa", gqa_candidates=2), store, config).cache.cpu_cache_bytes == \
        (1 << 20) - store.summary_bytes
    for other in ("spec", "spec_gqa"):  # spec_gqa without its candidate stage reads no summary
        assert Engine(model, make_system(other), store, config).cache.cpu_cache_bytes == 1 << 20


def test_retention_is_reported_of_the_whole_prefix_not_of_the_candidates():
    model = specjax.load_model("tiny-gqa", init="random", seed=1)
    r = _run(_engine(model, make_system("spec_gqa", gqa_candidates=2), 0.25), _request(model, prefix_len=160, seed=3))
    np.testing.assert_allclose(r.layers["retained"], math.ceil(0.25 * 160) / 160, rtol=1e-6)
