"""Prefix KV at low precision: the store's low-bit kinds (written, read, checked, copied by reordering), loading at
`kv_bits` for a system, and spec_mixed, which loads what SPEC does not select at `rest_bits`, against a plain forward
over the same KV round-tripped through the codec (`kernels.quant`: K per chunk and channel, `encode_key_chunks`; V per
row, `encode_rows`)."""

import dataclasses
import time

import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

import specjax
import toy_kv
from specjax.engine import Engine, EngineConfig, Request, fingerprint, make_engine, make_system
from specjax.engine import steps as S
from specjax.errors import SpecjaxError
from specjax.kernels import SharedIndices, quant
from specjax.models import transformer as T
from specjax.stores import K, PROBE, V, KVStore, Locations
from specjax.stores.errors import StoreMismatchError
from specjax.stores.kvarray import K_RANGE, base_of, bits_of, low_bit

FP = {"num_layers": 2, "kv_heads": 2, "head_dim": 64, "probe_heads": 1, "chunk_tokens": 16}


@pytest.fixture(scope="module")
def model():
    return specjax.load_model("tiny-llama", init="random", seed=1)


def _kv(rng, n, layers=2):
    return [tuple(rng.normal(size=(h, n, 64)).astype(np.float32) * 2 for h in (2, 2, 1)) for _ in range(layers)]


def _memory():
    return {"driver": "memory", "path": f"kv{np.random.randint(1 << 30)}/"}


def test_layout_kinds_and_row_sizes():
    st = KVStore.open(_memory(), {**FP, "kv_bits": [2, 4]}, context=ts.Context())
    lay = st.layout
    assert lay.bits == (4, 2)
    assert lay.kinds() == (0, 1, 2, low_bit(K, 4), low_bit(V, 4), low_bit(PROBE, 4), low_bit(K, 2), low_bit(V, 2),
                           low_bit(PROBE, 2), K_RANGE)
    assert [base_of(kind) for kind in lay.kinds()] == [K, V, PROBE] * 3 + [K]
    assert [bits_of(kind) for kind in lay.kinds()] == [None] * 3 + [4] * 3 + [2] * 3 + [None]
    kinds = set(map(low_bit, [K, V, PROBE] * 3, [8] * 3 + [4] * 3 + [2] * 3)) | {K_RANGE}
    assert len(kinds) == 10 and not kinds & {K, V, PROBE}  # no kind twice
    # V: 64 channels at 4 bits (32 bytes) and two groups' float16 scale and zero (8 bytes), 40 bytes; K: the codes,
    # 32 bytes, and its chunk's range, 64 float16 minima and maxima over 16 rows: 16 bytes a row
    assert lay.width(low_bit(V, 4)) == 40 and lay.width(low_bit(V, 2)) == 24 and lay.width(K) == 64
    assert lay.width(low_bit(K, 4)) == 32 and lay.width(low_bit(K, 2)) == 16 and lay.width(K_RANGE) == 16
    assert lay.dtype_of(low_bit(K, 4)) == np.uint8 and lay.dtype_of(K_RANGE) == np.uint8
    assert lay.dtype_of(K) == np.float32
    assert lay.token_nbytes(low_bit(V, 4)) == 2 * 40 and lay.token_nbytes(low_bit(PROBE, 4)) == 1 * 40
    st.close()


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_low_bit_rows_round_trip_through_the_store(tmp_path, bits):
    """What a store reads back of a low-bit kind decodes to the codec's round trip of the K and V written, at the
    codec's bound (half a group's step), and its bytes are the codec's bytes: V's and probe keys' rows each on its own,
    K's codes and ranges per chunk and channel (the last chunk's padding rows zero)."""
    rng = np.random.default_rng(bits)
    st = KVStore.open(tmp_path / "s", {**FP, "kv_bits": [bits]})
    kv = _kv(rng, 40)
    tokens = np.arange(40)
    st.insert(tokens, kv)
    with st.match(tokens) as match:
        for layer in range(2):
            loc = st.locate(match, np.arange(40), layer)
            padded = np.zeros((2, 48, 64), np.float32)  # 3 chunks of 16 tokens
            padded[:, :40] = kv[layer][K]
            codes, ranges = quant.encode_key_chunks(padded, bits=bits, chunk_tokens=16, keys=np.arange(48) < 40)
            got = [st.read_locations(layer, kind, loc).result() for kind in (low_bit(K, bits), K_RANGE)]
            assert all(g.ok.all() for g in got)
            np.testing.assert_array_equal(got[0].array, codes[:, :40])
            np.testing.assert_array_equal(got[1].array, ranges[:, :40])
            whole = st.read_locations(layer, K_RANGE, Locations(np.repeat(np.unique(loc.chunks), 16),
                                                                np.tile(np.arange(16), 3))).result()
            lo, hi = quant.key_ranges(jnp.asarray(whole.array), head_dim=64, chunk_tokens=16)
            decoded = np.asarray(quant.decode_key_codes(jnp.asarray(got[0].array), lo, hi, jnp.arange(40) // 16,
                                                        bits=bits, head_dim=64))
            x = np.where(np.arange(48)[:, None] < 40, padded, np.nan).reshape(2, 3, 16, 64)  # the keys, not padding
            step = np.repeat((np.nanmax(x, 2) - np.nanmin(x, 2)) / ((1 << bits) - 1), 16, axis=1)[:, :40]
            assert (np.abs(decoded - kv[layer][K]) <= 0.5 * step * 1.01 + 1e-6).all()
            for kind in (V, PROBE):
                got = st.read_locations(layer, low_bit(kind, bits), loc).result()
                assert got.ok.all()
                want = quant.encode_rows(kv[layer][kind], bits=bits, group=32, row_bytes=st.layout.token_row_nbytes(
                    low_bit(kind, bits)))
                np.testing.assert_array_equal(got.array.view(np.uint8), want)
                decoded = np.asarray(quant.decode_rows(jnp.asarray(got.array), bits=bits, group=32, head_dim=64))
                heads = kv[layer][kind].shape[0]
                x = kv[layer][kind].reshape(heads, 40, 2, 32)
                scale = (x.max(-1) - x.min(-1)) / ((1 << bits) - 1)
                err = np.abs(decoded - kv[layer][kind]).reshape(heads, 40, 2, 32).max(-1)
                assert (err <= 0.5 * scale * 1.01 + 1e-6).all()
    st.close()


def test_a_store_of_other_precisions_is_refused_by_name(tmp_path):
    KVStore.open(tmp_path / "s", {**FP, "kv_bits": [4]}).close()
    with pytest.raises(StoreMismatchError, match="holds K and V at float32 and 4 bits, not at float32 and 2 bits"):
        KVStore.open(tmp_path / "s", {**FP, "kv_bits": [2]})
    with pytest.raises(StoreMismatchError, match="not at float32 only"):
        KVStore.open(tmp_path / "s", FP)
    KVStore.open(tmp_path / "s", {**FP, "kv_bits": [4]}).close()  # its own precisions: opened


def _engine(model, name, retention=0.25, **options):
    system = make_system(name, **options)
    store = KVStore.open(_memory(), fingerprint(model, 16, system.store_bits), context=ts.Context())
    config = EngineConfig(retention=retention, gpu_cache_bytes=64 << 10, cpu_cache_bytes=64 << 10, trace=True,
                          cake_chunk_tokens=32)
    return make_engine(model, system, store, config)


def _request(model, prefix_len=100, query_len=7, seed=0):
    rng = np.random.default_rng(seed)
    v = model.config.vocab_size
    return Request(rng.integers(0, v, prefix_len).tolist(), rng.integers(0, v, query_len).tolist(),
                   [rng.integers(0, v, 3).tolist()])


def _logits_over(model, req, layer_kv):
    """The first token's logits of the query attending to prefix K/V `layer_kv` ((k, v) per layer, [H_kv, m, d]) and
    to its own: the engine's device steps, every prefix row attended."""
    cfg, params = model.config, model.params
    m, n = len(req.prefix), len(req.query)
    positions = jnp.arange(m, m + n, dtype=jnp.int32)
    h = T.embed_step(cfg, params, jnp.asarray(req.query, jnp.int32), positions)
    rotary = T.rotary_step(cfg, positions)
    every = SharedIndices(jnp.arange(m, dtype=jnp.int32), m)
    for lp, (keys, values) in zip(params["layers"], layer_kv):
        q, own_k, own_v = S.project(cfg, lp, h, positions, rotary)
        h = S.finish(cfg, lp, h, q, own_k, own_v, jnp.asarray(keys), jnp.asarray(values), every, n, impl="reference")
    return np.asarray(S.head_row(cfg, params, h, n - 1))


def _prefix_kv(engine, req):
    """Every layer's stored prefix K and V at full precision, as the engine wrote them."""
    store, m = engine.store, len(req.prefix)
    with store.match(req.prefix) as match:
        out = []
        for layer in range(engine.cfg.num_layers):
            loc = store.locate(match, np.arange(m), layer)
            out.append(tuple(store.read_locations(layer, kind, loc).result().array for kind in (K, V)))
    return out


def _round_trip(x, bits, keys=False, chunk_tokens=16):
    """V's rows, or K per chunk (`keys`: a prefix stored from position 0 in chunks of `chunk_tokens`, the last one
    padded, its padding left out of its range), through the store's codec and back."""
    heads, m, d = x.shape
    if keys:
        padded = np.zeros((heads, -(-m // chunk_tokens) * chunk_tokens, d), np.float32)
        padded[:, :m] = x
        codes, ranges = quant.encode_key_chunks(padded, bits=bits, chunk_tokens=chunk_tokens,
                                                keys=np.arange(padded.shape[1]) < m)
        lo, hi = quant.key_ranges(jnp.asarray(ranges), head_dim=d, chunk_tokens=chunk_tokens)
        return np.asarray(quant.decode_key_codes(jnp.asarray(codes[:, :m]), lo, hi, jnp.arange(m) // chunk_tokens,
                                                 bits=bits, head_dim=d))
    group = min(32, d)  # the store's default group
    return np.asarray(quant.decode_rows(jnp.asarray(quant.encode_rows(x, bits=bits, group=group)), bits=bits,
                                        group=group, head_dim=d))


def test_reference_forward_is_as_full(model):
    engine = _engine(model, "as_full", retention=1.0)
    req = _request(model)
    engine.warm(req.prefix)
    got = engine.run(req).first_token_logits
    np.testing.assert_allclose(got, _logits_over(model, req, _prefix_kv(engine, req)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("name", ["as_full", "as_h2o_lfu"])
def test_kv_bits_attends_to_the_round_tripped_kv(model, name, bits):
    """A system at kv_bits attends to its stored KV as the codec round-trips it: as_full exactly so (its logits are
    the reference forward's over the decoded KV), and H2O as it selects over the decoded keys."""
    engine = _engine(model, name, retention=1.0, kv_bits=bits)
    assert engine.system.name == f"{name}-kv{bits}" and engine.store.layout.bits == (bits,)
    req = _request(model)
    engine.warm(req.prefix)
    got = engine.run(req)
    decoded = [(_round_trip(k, bits, keys=True), _round_trip(v, bits)) for k, v in _prefix_kv(engine, req)]
    np.testing.assert_allclose(got.first_token_logits, _logits_over(model, req, decoded), atol=1e-5, rtol=0)
    full = _logits_over(model, req, _prefix_kv(engine, req))
    assert not np.allclose(got.first_token_logits, full, atol=1e-5)  # the precision did change what it attended to


def _touched(engine, req, selections):
    """Per layer, bool [m]: the positions in a chunk the layer's selection (any head's) touches, which spec_mixed loads
    whole at the selection's precision."""
    store, m = engine.store, len(req.prefix)
    with store.match(req.prefix) as match:
        out = []
        for layer, chosen in enumerate(selections):
            chunks = store.locate(match, np.arange(m), layer).chunks
            out.append(np.isin(chunks, chunks[np.unique(chosen)]))
    return out


def _mixed(low, high, touched):
    """`low` [heads, m, d] with `high`'s rows where `touched`."""
    out = np.array(low)
    out[:, touched] = high[:, touched]
    return out


def _a_mix(touched):
    """Some layer's selection left some chunks untouched (and touched others): the rest's precision shows."""
    assert any(0 < t.mean() < 1 for t in touched), [t.mean() for t in touched]


def test_spec_mixed_loads_the_selections_chunks_whole_over_the_low_bit_rest(model):
    """spec_mixed's layers attend to every prefix position: the chunks SPEC's selection touches at full precision,
    whole, the other positions' values decoded from 4 bits; tiny-llama's probe keys are its K, so every key is the
    probe keys' (full precision). At retention 1.0 every row is selected and it equals as_full."""
    req = _request(model, prefix_len=320)
    engine = _engine(model, "spec_mixed", retention=0.05)
    assert engine.store.layout.bits == (8, 4)  # its rest's keys at 8 bits where it reads them (not here)
    engine.warm(req.prefix)
    got = engine.run(req)
    kv = _prefix_kv(engine, req)
    touched = _touched(engine, req, got.selections)
    _a_mix(touched)
    layer_kv = [(k, _mixed(_round_trip(v, 4), v, t)) for (k, v), t in zip(kv, touched)]
    np.testing.assert_allclose(got.first_token_logits, _logits_over(model, req, layer_kv), atol=1e-5, rtol=0)
    spec = _engine(model, "spec", retention=0.05)
    spec.warm(req.prefix)
    dropped = spec.run(req)
    # the first layer sees the same inputs and selects as SPEC does (later ones see hidden states that attended more)
    np.testing.assert_array_equal(dropped.selections[0], got.selections[0])
    assert not np.allclose(dropped.first_token_logits, got.first_token_logits, atol=1e-3)

    everything = _engine(model, "spec_mixed", retention=1.0)
    everything.warm(req.prefix)
    np.testing.assert_allclose(everything.run(req).first_token_logits, _logits_over(model, req, kv), atol=1e-5,
                               rtol=0)


def test_spec_mixed_at_kv_bits_loads_its_selections_chunks_at_those_bits(model):
    """spec_mixed-kv8: the chunks SPEC's selection touches decoded from 8 bits, the other positions' values from 4,
    every key the 8-bit probe keys' (tiny-llama's probe keys are its K); at retention 1.0 every row is selected and it
    equals as_full-kv8."""
    req = _request(model, prefix_len=320)
    engine = _engine(model, "spec_mixed", retention=0.05, kv_bits=8)
    engine.warm(req.prefix)
    got = engine.run(req)
    touched = _touched(engine, req, got.selections)
    _a_mix(touched)
    layer_kv = [(_round_trip(k, 8, keys=True), _mixed(_round_trip(v, 4), _round_trip(v, 8), t))
                for (k, v), t in zip(_prefix_kv(engine, req), touched)]
    np.testing.assert_allclose(got.first_token_logits, _logits_over(model, req, layer_kv), atol=1e-5, rtol=0)
    runs = []
    for name in ("spec_mixed", "as_full"):
        everything = _engine(model, name, retention=1.0, kv_bits=8)
        everything.warm(req.prefix)
        runs.append(everything.run(req).first_token_logits)
    np.testing.assert_array_equal(*runs)


@pytest.mark.parametrize("key_bits", [8, 4])
def test_spec_mixed_rests_keys_load_at_rest_key_bits(key_bits):
    """tiny-gqa's probe heads are two of its four KV heads, so spec_mixed reads its rest's keys: at 8 bits by default
    (`rest_key_bits`), at 4 as spec_mixed-restk4, its values at 4 either way; a shared layer's touched chunks at full
    precision over them, a per-head layer's keys all taken at full precision."""
    model = specjax.load_model("tiny-gqa", init="random", seed=1)
    options = {} if key_bits == 8 else {"rest_key_bits": 4}
    engine = _engine(model, "spec_mixed", retention=0.05, alpha=50.0, **options)
    assert not engine.identification.keys_at_hand(engine.facts) and engine.identification.key_bits == key_bits
    assert engine.identification.selection_reads(engine.facts) == (K, V)  # what a guess reads ahead
    at_8 = _engine(model, "spec_mixed", retention=0.05, kv_bits=8, **options)
    # at 8 bits, every key of the rest is the selection's too: a guess reads only values (unless the keys are at 4)
    assert at_8.identification.selection_reads(at_8.facts) == ((V,) if key_bits == 8 else (K, V))
    req = _request(model, prefix_len=320)
    got, kinds = _run_taking(engine, req)
    other = {8: 4, 4: 8}[key_bits]
    assert {low_bit(K, key_bits), low_bit(V, 4)} <= kinds and low_bit(K, other) not in kinds
    assert any(len(chosen) == 1 for chosen in got.selections)
    touched = _touched(engine, req, got.selections)
    _a_mix([t for t, chosen in zip(touched, got.selections) if len(chosen) == 1])
    layer_kv = []
    for (k, v), chosen, t in zip(_prefix_kv(engine, req), got.selections, touched):
        # a per-head layer: every key taken at full precision
        keys = k if len(chosen) > 1 else _mixed(_round_trip(k, key_bits, keys=True), k, t)
        layer_kv.append((keys, _mixed(_round_trip(v, 4), v, t)))
    np.testing.assert_allclose(got.first_token_logits, _logits_over(model, req, layer_kv), atol=1e-5, rtol=0)


def _run_taking(engine, req):
    """`req` run by `engine` over its stored prefix (stored first, unrecorded): (the result, the store kinds its takes
    read)."""
    engine.warm(req.prefix)
    kinds, original = set(), engine.prefetcher.take

    def recorded(match, layer, kind, *args, **kwargs):
        kinds.add(kind)
        return original(match, layer, kind, *args, **kwargs)

    engine.prefetcher.take = recorded
    return engine.run(req), kinds


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_spec_mixed_keys_are_its_probe_keys_where_those_are_every_kv_heads(model, kv_bits):
    """tiny-llama's probe heads span both its KV heads, so its probe keys are its K: spec_mixed then reads no low-bit
    K for its rest; a shared layer's keys are every position's probe keys, at the selection's precision, and only V's
    rest is at 4 bits. alpha 50: the probe heads' agreement test passes, so every layer keeps a shared set."""
    engine = _engine(model, "spec_mixed", retention=0.05, alpha=50.0, **({"kv_bits": kv_bits} if kv_bits else {}))
    assert engine.facts.probe_is_k and engine.identification.keys_at_hand(engine.facts)
    req = _request(model, prefix_len=320)
    got, kinds = _run_taking(engine, req)
    assert low_bit(V, 4) in kinds and low_bit(K, 4) not in kinds
    assert all(len(chosen) == 1 for chosen in got.selections)
    touched = _touched(engine, req, got.selections)
    _a_mix(touched)
    layer_kv = []
    for (k, v), t in zip(_prefix_kv(engine, req), touched):
        keys, selected = (k, v) if kv_bits is None else (_round_trip(k, kv_bits, keys=True), _round_trip(v, kv_bits))
        layer_kv.append((keys, _mixed(_round_trip(v, 4), selected, t)))
    np.testing.assert_allclose(got.first_token_logits, _logits_over(model, req, layer_kv), atol=1e-5, rtol=0)


def test_spec_mixed_reads_each_chunk_once_at_one_precision():
    """Caches off, spec_mixed-kv8 on tiny-gqa (its rest's keys at 8 bits, as its selection's): each layer reads every
    chunk's 8-bit K and key ranges once, its probe keys as rows of them, and each chunk's V once, at 8 bits where the
    selection touches it and at 4 elsewhere. The store reads whole chunks: nothing it read is read again. It attends
    to that KV."""
    model = specjax.load_model("tiny-gqa", init="random", seed=1)
    system = make_system("spec_mixed", kv_bits=8, alpha=50.0)
    store = KVStore.open(_memory(), fingerprint(model, 16, system.store_bits), context=ts.Context())
    engine = make_engine(model, system, store, EngineConfig(retention=0.05, trace=True))
    req = _request(model, prefix_len=320)
    engine.warm(req.prefix)
    reads, original = [], store.read_runs

    def recorded(layer, kind, chunks, **kwargs):
        reads.extend((layer, kind, int(c)) for c in chunks)
        return original(layer, kind, chunks, **kwargs)

    store.read_runs = recorded
    got = engine.run(req)
    assert len(reads) == len(set(reads))  # no chunk of a kind read twice in a layer
    assert {kind for _, kind, _ in reads} == {low_bit(K, 8), low_bit(V, 8), low_bit(V, 4), K_RANGE}
    assert got.io["probe_disk_bytes"] == 0
    touched = _touched(engine, req, got.selections)
    _a_mix(touched)
    with store.match(req.prefix) as match:
        for layer, t in enumerate(touched):
            chunks = store.locate(match, np.arange(len(req.prefix)), layer).chunks
            read = {kind: {c for lay, kd, c in reads if lay == layer and kd == kind} for kind in
                    (low_bit(K, 8), low_bit(V, 8), low_bit(V, 4), K_RANGE)}
            assert read[low_bit(K, 8)] == read[K_RANGE] == set(chunks.tolist())
            assert read[low_bit(V, 8)] >= set(chunks[t].tolist())  # and any a guess read ahead
            assert read[low_bit(V, 4)] == set(chunks[~t].tolist())
    layer_kv = [(_round_trip(k, 8, keys=True), _mixed(_round_trip(v, 4), _round_trip(v, 8), t))
                for (k, v), t in zip(_prefix_kv(engine, req), touched)]
    np.testing.assert_allclose(got.first_token_logits, _logits_over(model, req, layer_kv), atol=1e-5, rtol=0)


def test_spec_mixed_guesses_window_closes_at_its_selections_take(monkeypatch):
    """spec_mixed-kv8 takes every position's 8-bit K for its probe keys, then its selection's V: a layer's guess (of
    V) has until the V is taken, so the speculation's window closes there, not at the keys' take."""
    from specjax.engine import layer_io, speculation

    model = specjax.load_model("tiny-gqa", init="random", seed=1)
    engine = _engine(model, "spec_mixed", retention=0.05, kv_bits=8, always_speculate=True)
    req = _request(model, prefix_len=320)
    engine.warm(req.prefix)
    events, take, observe = [], layer_io.LayerIO.take, speculation.Speculator.observe_window

    def taking(self, layer, kind, *args, **kwargs):
        events.append((layer, self.path.precision.kind(kind)))
        return take(self, layer, kind, *args, **kwargs)

    def observing(self, opened):
        events.append("window")
        return observe(self, opened)

    monkeypatch.setattr(layer_io.LayerIO, "take", taking)
    monkeypatch.setattr(speculation.Speculator, "observe_window", observing)
    engine.run(req)
    closed_at = [events[i - 1][1] for i, e in enumerate(events) if e == "window"]
    assert closed_at and set(closed_at) == {low_bit(V, 8)}, closed_at
    assert (1, low_bit(K, 8)) in events  # taken, without closing the window


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gqa"])
def test_spec_gqa_with_a_rest_reads_no_low_bit_keys(name):
    """spec_gqa scores with every KV head's keys (its probe KV heads' queries over K, or the store's probe kind where
    that holds them all), so a rest at 4 bits is V's alone; its shared layers hand their keys over whole."""
    model = specjax.load_model(name, init="random", seed=1)
    system = dataclasses.replace(make_system("spec_gqa", alpha=50.0), rest_bits=4)
    store = KVStore.open(_memory(), fingerprint(model, 16, system.store_bits), context=ts.Context())
    engine = make_engine(model, system, store, EngineConfig(retention=0.25, trace=True))
    assert engine.identification.keys_at_hand(engine.facts)
    req = _request(model)
    got, kinds = _run_taking(engine, req)
    assert low_bit(V, 4) in kinds and low_bit(K, 4) not in kinds
    assert any(len(chosen) == 1 for chosen in got.selections)
    assert np.isfinite(got.first_token_logits).all()


def test_a_system_needing_bits_its_store_lacks_is_refused(model):
    system = make_system("as_full", kv_bits=4)
    store = KVStore.open(_memory(), fingerprint(model, 16), context=ts.Context())
    with pytest.raises(SpecjaxError, match="loads K and V at 4 bits, but its store holds K and V at float32 only"):
        Engine(model, system, store, EngineConfig())
    with pytest.raises(SpecjaxError, match="rest_bits loads the tokens an identification leaves out"):
        dataclasses.replace(make_system("as_full"), rest_bits=2)
    with pytest.raises(SpecjaxError, match="kv_bits must be one of"):
        make_system("as_full", kv_bits=3)


def test_reordering_copies_low_bit_rows_with_their_tokens(tmp_path):
    """A reordered segment's low-bit rows are its tokens' rows, encoded anew from the full-precision ones it copies:
    reads in the prefix's order give V's rows as written, and K's codes and ranges as its new chunks encode them."""
    from specjax.stores.reorder import reorder_node

    rng = np.random.default_rng(3)
    fp = {**FP, "kv_bits": [4]}
    tokens, kv = np.arange(100), _kv(rng, 100)
    with KVStore.open(tmp_path / "s", fp) as store:
        store.insert(tokens, kv)
        important = rng.choice(100, 16, replace=False)
        with store.match(tokens) as m:
            store.record_importance(m, np.ones(16), positions=important)
            node = m.steps[0].node_id
        assert reorder_node(store, node)
        store.collect_garbage()
        with store.match(tokens) as m:
            assert len(store.locate(m, important, 0).unique_chunks()) == 1  # packed together
            for layer in range(2):
                loc = store.locate(m, np.arange(100), layer)
                got = {kind: store.read_locations(layer, kind, loc).result()
                       for kind in (K, low_bit(K, 4), K_RANGE, low_bit(V, 4))}
                assert all(g.ok.all() for g in got.values())
                np.testing.assert_array_equal(got[K].array, kv[layer][K])
                want = quant.encode_rows(kv[layer][V], bits=4, group=32,
                                         row_bytes=store.layout.token_row_nbytes(low_bit(V, 4)))
                np.testing.assert_array_equal(got[low_bit(V, 4)].array, want)
                chunks = np.unique(loc.chunks)  # the new chunks' keys, whole, encoded over their tokens' rows
                whole = Locations(np.repeat(chunks, 16), np.tile(np.arange(16), len(chunks)))
                codes, ranges = quant.encode_key_chunks(store.read_locations(layer, K, whole).result().array, bits=4,
                                                        chunk_tokens=16, keys=toy_kv.key_rows(store, chunks))
                rows = np.searchsorted(chunks, loc.chunks) * 16 + loc.offsets
                np.testing.assert_array_equal(got[low_bit(K, 4)].array, codes[:, rows])
                np.testing.assert_array_equal(got[K_RANGE].array, ranges[:, rows])


def test_cake_loads_its_chunks_at_kv_bits(model, monkeypatch):
    """Cake at 4 bits: the chunks its loader brings are decoded from 4 bits, the ones the device computes are exact."""
    from specjax.engine.cake import CakeEngine

    chunk_layer = CakeEngine._chunk_layer

    def slow(self, *args):  # the device slower than the in-memory store: the loader brings all but the first chunk
        time.sleep(0.2)
        return chunk_layer(self, *args)

    monkeypatch.setattr(CakeEngine, "_chunk_layer", slow)
    engine = _engine(model, "cake", retention=1.0, kv_bits=4)
    assert engine.system.name == "cake-kv4"
    req = _request(model, seed=4)
    engine.warm(req.prefix)
    got = engine.run(req)
    computed = got.split["computed_prefix_tokens"]
    assert got.split["loaded_prefix_tokens"] >= 50
    mixed = []
    for k, v in _prefix_kv(engine, req):
        mk, mv = np.array(_round_trip(k, 4, keys=True)), np.array(_round_trip(v, 4))
        mk[:, :computed], mv[:, :computed] = k[:, :computed], v[:, :computed]
        mixed.append((mk, mv))
    np.testing.assert_allclose(got.first_token_logits, _logits_over(model, req, mixed), atol=1e-4, rtol=0)
    assert not np.allclose(got.first_token_logits, _logits_over(model, req, _prefix_kv(engine, req)), atol=1e-4)


def test_a_run_names_precision_variants_of_its_systems():
    """--systems takes NAME-kvB for any system that reuses KV and spec_mixed-restB; results say the bits."""
    from specjax.eval import registry
    from specjax.eval.errors import EvalError
    from specjax.eval.report_markdown import _bits_cell

    assert registry.resolve("as_full,as_full-kv4,spec_mixed-rest2,cake-kv2,spec_mixed-kv8-rest2") == [
        "as_full", "as_full-kv4", "spec_mixed-rest2", "cake-kv2", "spec_mixed-kv8-rest2"]
    assert registry.precision_variant("spec_mixed-rest2") == ("spec_mixed", {"rest_bits": 2})
    assert registry.precision_variant("spec_mixed-kv8-rest2") == ("spec_mixed", {"rest_bits": 2, "kv_bits": 8})
    assert registry.precision_variant("spec_mixed-kv8-restk4") == ("spec_mixed", {"rest_key_bits": 4, "kv_bits": 8})
    assert make_system("spec_mixed", kv_bits=8, rest_key_bits=4).name == "spec_mixed-kv8-restk4"
    assert make_system("spec_mixed").store_bits == (8, 4) and make_system("spec", rest_key_bits=4).rest_key_bits is None
    assert registry.resolve("planner-plan4,planner-kv8-plan4") == ["planner-plan4", "planner-kv8-plan4"]
    assert registry.precision_variant("planner-kv8-plan4") == ("planner", {"plan_bits": 4, "kv_bits": 8})
    assert registry.precision_variant("as_full-plan4") is None and registry.precision_variant("spec-plan4") is None
    for bad in ("recompute-kv4", "as_full-rest2", "spec-kv3", "spec_mixed-rest2-kv8"):
        with pytest.raises(EvalError, match="NAME-kv8, NAME-kv4, NAME-kv2"):
            registry.resolve(bad)
    assert registry.uses_retention("spec_mixed-rest2") and not registry.uses_retention("as_full-kv4")
    from specjax.engine.systems import SystemOptions
    registry.check_distinct(["as_full", "as_full-kv4"], SystemOptions())
    with pytest.raises(EvalError, match="as_full and as_full-kv4 are both built as as_full-kv4"):
        registry.check_distinct(["as_full", "as_full-kv4"], SystemOptions(kv_bits=4))
    assert _bits_cell({"selected_bits": 32, "rest_bits": 2}) == "32 / 2"
    assert _bits_cell({"selected_bits": 8, "rest_bits": 4, "rest_key_bits": 8}) == "8 / 4 (its keys 8)"
    assert _bits_cell({"selected_bits": 4, "rest_bits": None}) == "4 / -" and _bits_cell(None) == "-"
    assert _bits_cell({"selected_bits": 32, "rest_bits": None, "plan_bits": [8, 4]}) == "32 / - (or 8, 4 as planned)"


@pytest.mark.parametrize("tiers", ["disk", "device tier", "host tier"])
def test_a_bfloat16_stores_low_bit_rows_reach_the_device_byte_for_byte(tiers):
    """Low-bit rows are bytes all the way (no float type carries them intact: XLA:CPU gathers bfloat16 through
    float32, flushing subnormal bit patterns): a take of a bfloat16 store's 4-bit V, K and K ranges gives the encoded
    rows exactly, from disk and from either cache tier."""
    import ml_dtypes

    from specjax.stores.caches import TieredCache
    from specjax.stores.prefetch import Prefetcher

    fp = {**FP, "num_layers": 1, "probe_heads": 0, "kv_bits": [4], "dtype": "bfloat16"}
    store = KVStore.open(_memory(), fp, context=ts.Context())
    k = (np.random.default_rng(0).normal(size=(2, 64, 64)) * 1e-3).astype(ml_dtypes.bfloat16)
    store.insert(np.arange(64), [(k, k)])
    budget = {"disk": (0, 0), "device tier": (1 << 20, 0), "host tier": (0, 1 << 20)}[tiers]
    prefetcher = Prefetcher(store, TieredCache(*budget, "lru", metrics=store.metrics))
    codes, ranges = quant.encode_key_chunks(k.astype(np.float32), bits=4, chunk_tokens=16)
    wants = {low_bit(V, 4): quant.encode_rows(k.astype(np.float32), bits=4, group=32), low_bit(K, 4): codes,
             K_RANGE: ranges}
    for kind, want in wants.items():
        for _ in range(2):  # the second take finds the first one's chunks in the tier
            with store.match(np.arange(64)) as m:
                positions = np.arange(64)
                taken = prefetcher.take(m, 0, kind, positions, pad_to=64, loc=store.locate(m, positions, 0))
                prefetcher.close()
            np.testing.assert_array_equal(np.asarray(taken.array), want)
    counts = store.metrics.snapshot()
    hit = {"disk": 0, "device tier": counts["device_hits"], "host tier": counts["host_hits"]}[tiers]
    assert hit == (0 if tiers == "disk" else 3 * 4)  # each kind's second take found its 4 chunks in the tier
    store.close()


def test_spec_at_kv_bits_reads_its_probe_keys_at_them_where_they_are_k(model):
    """tiny-llama's probe heads are every KV head's keys: spec-kv8 reads them from the 8-bit K, and every read and
    take of its requests is of 8-bit rows."""
    engine = _engine(model, "spec", retention=0.25, kv_bits=8)
    assert engine.facts.probe_is_k and engine.precision.kind(PROBE) == low_bit(K, 8)
    req = _request(model)
    engine.warm(req.prefix)
    kinds = set()
    for name in ("request", "take"):
        original = getattr(engine.prefetcher, name)

        def recorded(match, layer, kind, *args, original=original, **kwargs):
            kinds.add(kind)
            return original(match, layer, kind, *args, **kwargs)

        setattr(engine.prefetcher, name, recorded)
    assert engine.run(req).io["disk_bytes"] > 0
    assert kinds == {low_bit(K, 8), low_bit(V, 8), K_RANGE}


def test_spec_at_kv_bits_reads_the_stores_low_bit_probe_keys():
    """tiny-gqa's probe heads are two of its four KV heads: spec-kv8 reads the store's 8-bit probe keys, and every
    read and take of its requests is of 8-bit rows."""
    model = specjax.load_model("tiny-gqa", init="random", seed=1)
    engine = _engine(model, "spec", retention=0.25, kv_bits=8)
    assert not engine.facts.probe_is_k and engine.precision.kind(PROBE) == low_bit(PROBE, 8)
    result, kinds = _run_taking(engine, _request(model))
    assert result.io["disk_bytes"] > 0 and result.io["probe_disk_bytes"] > 0
    assert low_bit(PROBE, 8) in kinds and K_RANGE in kinds
    assert {bits_of(kind) for kind in kinds - {K_RANGE}} == {8}


def test_a_bfloat16_stores_host_tier_holds_every_kind():
    """The host tier's page arrays hold each kind's own element type (bfloat16 K and V, bytes for low-bit rows)."""
    import ml_dtypes

    from specjax.stores.caches import TieredCache
    from specjax.stores.prefetch import Prefetcher

    fp = {**FP, "num_layers": 1, "probe_heads": 0, "kv_bits": [2, 4], "dtype": "bfloat16"}
    store = KVStore.open(_memory(), fp, context=ts.Context())
    k = np.random.default_rng(1).normal(size=(2, 64, 64)).astype(ml_dtypes.bfloat16)
    store.insert(np.arange(64), [(k, k)])
    prefetcher = Prefetcher(store, TieredCache(0, 1 << 20, "lru", metrics=store.metrics))
    for kind, want in ((K, k), (low_bit(V, 2), quant.encode_rows(k.astype(np.float32), bits=2, group=32))):
        for _ in range(2):
            with store.match(np.arange(64)) as m:
                positions = np.arange(64)
                taken = prefetcher.take(m, 0, kind, positions, pad_to=64, loc=store.locate(m, positions, 0))
                prefetcher.close()
            np.testing.assert_array_equal(np.asarray(taken.array), want)
    assert store.metrics.snapshot()["host_hits"] == 8  # each kind's second take: its 4 chunks from the host tier
    with pytest.raises(StoreMismatchError, match="holds K and V at bfloat16 and 4, 2 bits"):
        KVStore.open(store.kvstore_spec, {**fp, "kv_bits": [4]}, context=store.context)
    store.close()


def test_precisions_a_system_cannot_combine_are_refused():
    with pytest.raises(SpecjaxError, match="both at 4 bits load every token at them"):
        make_system("spec_mixed", kv_bits=4)
    with pytest.raises(SpecjaxError, match="rest_bits with a candidate stage is not built"):
        dataclasses.replace(make_system("spec_gqa", gqa_candidates=2), rest_bits=4)
    # a precision is named first, the other options after it, so a run's NAME-kvB finds what it built
    assert make_system("spec", kv_bits=4, no_prefetch=True).name == "spec-kv4-no_prefetch"


def test_a_low_bit_store_of_the_earlier_format_is_refused(tmp_path, model):
    """A store whose low-bit KV is of an earlier format (1: K and V only, no low-bit probe keys; 2: K in rows that
    decode alone) is refused by name."""
    fp = fingerprint(model, 16, (4,))
    assert fp["kv_format"] == 3
    KVStore.open(tmp_path / "s", {k: v for k, v in fp.items() if k != "kv_format"}).close()
    with pytest.raises(StoreMismatchError, match="earlier format of specjax .format 1: K and V only"):
        KVStore.open(tmp_path / "s", fp)
    KVStore.open(tmp_path / "s2", {**fp, "kv_format": 2}).close()
    with pytest.raises(StoreMismatchError, match="format 2: K in rows that decode alone.*not format 3"):
        KVStore.open(tmp_path / "s2", fp)
    KVStore.open(tmp_path / "new", fp).close()  # a store of today's format asked for none: named as before
    with pytest.raises(StoreMismatchError, match="holds K and V at float32 and 4 bits, not at float32 only"):
        KVStore.open(tmp_path / "new", fingerprint(model, 16))
