"""Cake on random tiny OPT and Llama models: exact, meets where the speeds put it, never serves a bad chunk."""

import time

import numpy as np
import pytest
import tensorstore as ts

import specjax
from specjax.engine import CakeEngine, Engine, EngineConfig, Request, fingerprint, make_engine, make_system
from specjax.engine import cake
from specjax.errors import SpecjaxError
from specjax.stores import KVStore

EXACT = 1e-5  # fp32, against the engine's recompute
STORE_CHUNK, CAKE_CHUNK = 16, 32


@pytest.fixture(scope="module", params=["tiny-opt", "tiny-llama"])
def model(request):
    return specjax.load_model(request.param, init="random", seed=1)


def _store(model, **kwargs):
    spec = {"driver": "memory", "path": f"kv{np.random.randint(1 << 30)}/"}
    return KVStore.open(spec, fingerprint(model, STORE_CHUNK), context=ts.Context(), **kwargs)


def _request(model, prefix_len=100, query_len=7, seed=0):
    rng = np.random.default_rng(seed)
    v = model.config.vocab_size
    return Request(rng.integers(0, v, prefix_len).tolist(), rng.integers(0, v, query_len).tolist(),
                   [rng.integers(0, v, 3).tolist(), rng.integers(0, v, 6).tolist()])


def _cake(model, store=None, **config):
    config = {"cake_chunk_tokens": CAKE_CHUNK, **config}
    return make_engine(model, make_system("cake"), store or _store(model), EngineConfig(**config))


def _recompute(model, req):
    return Engine(model, make_system("recompute"), None).run(req)


def _assert_same_outputs(r, base):
    np.testing.assert_allclose(r.first_token_logits, base.first_token_logits, atol=EXACT, rtol=0)
    np.testing.assert_allclose([c for c, _ in r.continuation_logprobs],
                               [c for c, _ in base.continuation_logprobs], atol=EXACT, rtol=0)
    assert [g for _, g in r.continuation_logprobs] == [g for _, g in base.continuation_logprobs]


@pytest.fixture
def slow_device(monkeypatch):
    """Every layer of a cake chunk computed on the device takes 0.2 s more: the loader always wins the race."""
    chunk_layer = CakeEngine._chunk_layer

    def slow(self, *args):
        time.sleep(0.2)
        return chunk_layer(self, *args)

    monkeypatch.setattr(CakeEngine, "_chunk_layer", slow)


def test_cake_equals_recompute(model):
    req = _request(model)  # 100 stored tokens: chunks of 32, 32, 32 and 4
    engine = _cake(model)
    assert isinstance(engine, CakeEngine)
    engine.warm(req.prefix)
    r = engine.run(req)
    _assert_same_outputs(r, _recompute(model, req))
    s = r.split
    assert s["stored_tokens"] == r.reused_tokens == 100 and s["chunks"] == 4
    assert s["computed_prefix_tokens"] + s["loaded_prefix_tokens"] == 100
    assert s["computed_chunks"] + s["loaded_chunks"] == 4
    assert s["computed_prefix_tokens"] == min(100, CAKE_CHUNK * s["computed_chunks"])
    assert r.computed_tokens == len(req.query) + s["computed_prefix_tokens"]
    assert r.breakdown_ms["probe_io"] == r.breakdown_ms["identify"] == 0.0


def test_partly_stored_prefix_is_completed_and_stored(model):
    req = _request(model, prefix_len=90, seed=2)
    engine = _cake(model)
    engine.warm(req.prefix[:40])
    r = engine.run(req)
    assert r.reused_tokens == 40 and r.split["stored_tokens"] == 40
    _assert_same_outputs(r, _recompute(model, req))
    again = engine.run(req)
    assert again.reused_tokens == 90
    _assert_same_outputs(again, _recompute(model, req))


def test_cold_request_is_a_chunked_prefill_written_behind(model):
    """Nothing stored: cake runs the engine's chunked prefill (chunks of 32 here) and stores the prefix."""
    req = _request(model, seed=4)
    engine = _cake(model, prefill_chunk_tokens=32)
    r = engine.run(req)
    assert r.reused_tokens == 0 and r.computed_tokens == 107 and r.split["stored_tokens"] == 0
    _assert_same_outputs(r, _recompute(model, req))
    again = engine.run(req)
    assert again.reused_tokens == 100 and again.split["stored_tokens"] == 100
    _assert_same_outputs(again, _recompute(model, req))


def test_slow_disk_leaves_everything_to_the_device(model):
    """At 100 bytes/s the loader cannot finish one chunk (tens of KB) before the device has computed them all."""
    req = _request(model, seed=3)
    engine = _cake(model, _store(model, disk_bandwidth=100.0))
    engine.warm(req.prefix)
    r = engine.run(req)
    assert r.split["computed_prefix_tokens"] == 100 and r.split["loaded_chunks"] == 0
    assert r.split["loader_gave_up_chunk"]
    _assert_same_outputs(r, _recompute(model, req))


def test_fast_loader_loads_nearly_everything(model, slow_device):
    """A device slower than the (unthrottled, in-memory) store: everything is loaded but at most the first
    chunk, which both sides race for."""
    req = _request(model, seed=4)
    engine = _cake(model)
    engine.warm(req.prefix)
    r = engine.run(req)
    assert r.split["computed_chunks"] <= 1 and r.split["loaded_prefix_tokens"] >= 100 - CAKE_CHUNK
    assert r.io["disk_bytes"] > 0 and r.io["chunks_read"] > 0
    _assert_same_outputs(r, _recompute(model, req))


def test_split_is_reported_to_the_evaluation(model, slow_device):
    """The counters the evaluation sums: computed vs reused prefix tokens, disk bytes."""
    from specjax.eval.engine_systems import _counters

    req = _request(model, seed=4)
    engine = _cake(model)
    engine.warm(req.prefix)
    counters = _counters(engine.run(req), len(req.prefix))
    assert counters["reused_tokens"] == 100 and counters["computed_prefix_tokens"] <= CAKE_CHUNK
    assert counters["retained_tokens"] == pytest.approx(100 - counters["computed_prefix_tokens"])
    assert counters["disk_bytes"] > 0


def test_chunk_size_must_be_a_multiple_of_the_store_chunk(model):
    with pytest.raises(SpecjaxError, match="multiple of the store's 16-token chunks"):
        _cake(model, cake_chunk_tokens=24)


def test_corrupt_chunk_is_computed_not_served(model, tmp_path, slow_device):
    req = _request(model, prefix_len=64, seed=13)  # chunks of 32: the loader reads chunk 1, then chunk 0
    store = KVStore.open(tmp_path / "store", fingerprint(model, STORE_CHUNK))
    engine = _cake(model, store)
    engine.warm(req.prefix)
    kv_files = sorted(p for p in (tmp_path / "store" / "kv").rglob("*") if p.is_file() and p.stat().st_size > 1024)
    victim = kv_files[len(kv_files) // 2]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    r = engine.run(req)
    assert r.recomputed_bad_chunks and r.split["bad_chunk"] and r.io["bad_chunks"] >= 1
    assert r.split["computed_prefix_tokens"] > 0
    _assert_same_outputs(r, _recompute(model, req))


def test_meeting_hands_the_last_chunk_to_whoever_finishes_it_first():
    m = cake._Meeting(3)
    assert m.next_to_compute(m.loaded_start()) == 0 and m.next_to_load() == 2
    assert m.publish(2, ["k"], ["v"])
    m.computed(0)
    assert m.next_to_compute(m.loaded_start()) == 1 and m.next_to_load() == 1  # both work on chunk 1
    m.computed(1)
    assert m.unneeded(1) and not m.publish(1, [], []) and m.next_to_load() is None
    assert m.next_to_compute(m.loaded_start()) is None and m.stop() == 2 and m.published(set(), 2) == [2]


def test_processes_go_by_the_chunks_every_loader_has():
    """Two processes' meetings agreeing as over a mesh of two (`agree`: the latest start either loader reached):
    a chunk one loader has published still counts as the device's until the other's has it too, and both hand
    the same chunks to their buffers."""
    both = []
    agree = lambda back: max(m.back for m in both)  # noqa: E731 -- distributed.max_over_processes, in one process
    a, b = cake._Meeting(4, agree), cake._Meeting(4, agree)
    both += [a, b]
    assert a.publish(3, ["k3"], ["v3"]) and a.publish(2, ["k2"], ["v2"])  # a's loader is ahead
    assert b.publish(3, ["k3"], ["v3"])
    assert a.loaded_start() == b.loaded_start() == 3  # chunk 2 is still the device's
    assert a.next_to_compute(3) == b.next_to_compute(3) == 0
    assert a.published(set(), 3) == b.published(set(), 3) == [3]
    for m in both:
        m.computed(0), m.computed(1)
    assert b.publish(2, ["k2"], ["v2"]) and a.loaded_start() == b.loaded_start() == 2
    assert a.stop() == b.stop() == 2 and a.published({3}, 2) == b.published({3}, 2) == [2]
