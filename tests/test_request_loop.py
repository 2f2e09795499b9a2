"""Every system runs the engine's one request loop (`Engine.attempt`); a schedule is its `prefill`. What a schedule
opened is closed when it fails part-way, and every schedule reports the same result fields."""

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

import specjax
from specjax.api import Model
from specjax.engine import (BlendEngine, CakeEngine, Engine, EngineConfig, PlannerEngine, Request, fingerprint,
                            make_engine, make_system)
from specjax.engine import cake
from specjax.engine.blend import blend_fingerprint, chunk_keys
from specjax.engine.layer_io import LayerIO
from specjax.models.params import init_params
from specjax.stores import KVStore

STORE_CHUNK = 16


@pytest.fixture(scope="module")
def model():
    """tiny-llama with a BOS token (CacheBlend's chunk sink)."""
    base = specjax.load_model("tiny-llama", init="random", seed=1)
    cfg = dataclasses.replace(base.config, bos_token_id=3)
    return Model("tiny-llama-bos", cfg, init_params(cfg, seed=1, dtype=jnp.float32), "random")


def _store(fp):
    spec = {"driver": "memory", "path": f"kv{np.random.randint(1 << 30)}/"}
    return KVStore.open(spec, fp, context=ts.Context())


def _request(model, prefix_len=80, query_len=7, seed=0):
    rng = np.random.default_rng(seed)
    v = model.config.vocab_size
    prefix = rng.integers(0, v, prefix_len).tolist()
    return Request(prefix, rng.integers(0, v, query_len).tolist(), [rng.integers(0, v, 4).tolist()],
                   chunks=[prefix[:30], prefix[30:]])


def _engine(model, name):
    fp = (blend_fingerprint if name in ("cacheblend", "full_reuse") else fingerprint)(model, STORE_CHUNK)
    return make_engine(model, make_system(name), _store(fp), EngineConfig(cake_chunk_tokens=32))


def _open_matches(store) -> int:
    return store.index.open_matches()


def test_every_engine_runs_the_one_request_loop():
    for engine in (CakeEngine, BlendEngine, PlannerEngine):
        assert engine.attempt is Engine.attempt or engine is PlannerEngine  # the planner only plans around it
        assert engine.prefill is not Engine.prefill or engine is PlannerEngine
    assert "attempt" not in vars(CakeEngine) and "attempt" not in vars(BlendEngine)


@pytest.mark.parametrize("name", ["as_full", "spec", "cake", "full_reuse"])
def test_every_schedule_reports_the_same_fields(model, name):
    engine = _engine(model, name)
    req = _request(model)
    if name == "full_reuse":
        for key in chunk_keys(req.chunks, engine.sink):
            engine.warm(key)
    else:
        engine.warm(req.prefix[:64])
    r = engine.run(req)
    assert r.reused_tokens == (80 if name == "full_reuse" else 64)
    assert 0.0 <= r.host_exposed_ms <= r.ttft_ms  # measured for every schedule, not only the layer loop
    assert 0.0 < r.cpu_ms <= r.ttft_ms * len(os.sched_getaffinity(0)) + 1  # so is the process's CPU time
    assert set(r.breakdown_ms) == {"probe_io", "identify", "kv_io_stall", "compute"}
    assert len(r.layers["retained"]) == model.config.num_layers
    assert set(r.prefetch) >= {"prefetch_issued", "precision"}
    assert len(r.continuation_logprobs) == 1 and np.isfinite(r.continuation_logprobs[0][0])
    assert _open_matches(engine.store) == 0


def test_a_failing_cake_loader_releases_the_prefix_and_stores_nothing(model, monkeypatch):
    engine = _engine(model, "cake")
    req = _request(model)
    engine.warm(req.prefix[:64])

    def broken(self, j):
        raise OSError("the disk went away")

    monkeypatch.setattr(cake._Loader, "_load", broken)
    with pytest.raises(OSError, match="went away") as failure:
        engine.run(req)
    # released by the schedule, not by the garbage collector: the failure's frames still hold what they opened
    assert failure.tb is not None and _open_matches(engine.store) == 0
    with engine.store.match(req.prefix) as match:
        assert match.length == 64  # the prefix's new tail was not committed
    monkeypatch.undo()
    r = engine.run(req)  # nothing left behind stands in the way of the next request
    assert r.reused_tokens == 64 and r.io["disk_bytes_written"] > 0
    with engine.store.match(req.prefix) as match:
        assert match.length == 80


def test_a_failing_blend_read_releases_every_chunk(model, monkeypatch):
    engine = _engine(model, "full_reuse")  # reads every layer (cacheblend recomputes all of a 2-layer model)
    req = _request(model)
    for key in chunk_keys(req.chunks, engine.sink):
        engine.warm(key)
    take_all = LayerIO.take_all

    def failing(self, layer, kind, phase="kv_io_stall"):
        if layer == 1:
            raise OSError("the disk went away")
        return take_all(self, layer, kind, phase)

    monkeypatch.setattr(LayerIO, "take_all", failing)
    with pytest.raises(OSError, match="went away") as failure:
        engine.run(req)
    # released by the schedule, not by the garbage collector: the failure's frames still hold what they opened
    assert failure.tb is not None and _open_matches(engine.store) == 0
    assert engine.prefetcher.buffered_bytes == 0
    monkeypatch.undo()
    assert engine.run(req).reused_tokens == 80
