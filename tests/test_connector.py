"""`specjax.Connector`: a layer loop of one's own stores a prompt's KV and reuses it layer by layer, with the logits a
plain forward gives; partial saves, corrupt chunks, read-only stores and misuse get clear outcomes; and the decode loop
in `examples/` answers as it would without the store."""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import bench_scripts  # tests/bench_scripts.py: loads a script as a module
import specjax
from specjax.engine.policy_steps import probe_kv_heads
from specjax.errors import SpecjaxError
from specjax.models import inference
from specjax.stores import K, KVStore, StoreError
from specjax.stores.fsck import fsck

ROOT = pathlib.Path(__file__).resolve().parent.parent
decode_loop = bench_scripts.load("../examples/decode_loop.py", "decode_loop_example")


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-opt"])
def model(request):
    return specjax.load_model(request.param, init="random", seed=5)


def _prompt(model, n, seed=0):
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, n).tolist()


@pytest.fixture
def store(model, tmp_path):
    """An empty store for `model` in tmp_path/kv, of 16-token chunks, closed after the test."""
    with specjax.open_store(model, tmp_path / "kv", chunk_tokens=16) as opened:
        yield opened


def test_a_stored_prompt_is_reused_layer_by_layer_with_the_plain_forwards_logits(model, store):
    prefix = _prompt(model, 40)
    prompt = prefix + _prompt(model, 7, seed=1)
    conn = specjax.Connector(store)
    _, _, reused = decode_loop.prefill(model, conn, prefix, 128, save=True)
    with store.match(prefix) as match:
        assert reused == 0 and match.length == len(prefix)  # stored by the loop's saves
    before = store.metrics.snapshot()["disk_bytes"]
    logits, cache, reused = decode_loop.prefill(model, conn, prompt, 128, save=False)
    assert reused == len(prefix) and store.metrics.snapshot()["disk_bytes"] > before
    plain = model.logits(prompt)[-1]
    # the probe keys it saves are the leading KV heads: those the engine stores (probe_kv_heads)
    assert probe_kv_heads(model.config) == tuple(range(store.layout.probe_heads))
    np.testing.assert_allclose(logits, plain, atol=2e-5, rtol=1e-5)
    # the cache holds the prompt's KV: decoding from it is decoding from a cache prefilled without the store
    reference = inference.empty_cache(model.config, 128, model.params["embed"].dtype)
    inference.extend(model.config, model.params, reference, prompt)
    for mine, theirs in zip(cache.k + cache.v, reference.k + reference.v):
        np.testing.assert_allclose(np.asarray(mine)[:, :len(prompt)], np.asarray(theirs)[:, :len(prompt)],
                                   atol=2e-5, rtol=1e-5)


def test_what_a_layer_waits_for_is_the_stored_kv_of_the_reused_tokens(model, store):
    prompt = _prompt(model, 37)
    cfg = model.config
    _, cache, _ = decode_loop.prefill(model, specjax.Connector(store), prompt, 64, save=True)
    conn = specjax.Connector(store)
    assert conn.begin(prompt) == len(prompt) - 1  # the last token is always left to compute
    conn.start_load()
    for layer in range(cfg.num_layers):
        k, v = conn.wait_for_layer(layer)
        assert k.shape == v.shape == (cfg.num_kv_heads, len(prompt) - 1, cfg.head_dim)
        np.testing.assert_array_equal(np.asarray(k), np.asarray(cache.k[layer])[:, :len(prompt) - 1])
        np.testing.assert_array_equal(np.asarray(v), np.asarray(cache.v[layer])[:, :len(prompt) - 1])
    own = jnp.zeros((cfg.num_kv_heads, 1, cfg.head_dim))
    conn.save_layer(0, own, own)
    assert conn.finish() is None  # the whole prompt was stored already: nothing to save


def test_a_partial_save_stores_nothing_and_leaves_a_store_fsck_passes(model, store, tmp_path):
    prompt = _prompt(model, 30)
    conn = specjax.Connector(store)
    assert conn.begin(prompt) == 0
    cfg = model.config
    kv = jnp.ones((cfg.num_kv_heads, len(prompt), cfg.head_dim), model.params["embed"].dtype)
    conn.save_layer(0, kv, kv)  # one layer of two
    assert conn.finish() is None
    with store.match(prompt) as match:
        assert match.length == 0
    store.close()
    assert fsck(tmp_path / "kv").ok


def test_a_corrupt_stored_chunk_raises_and_the_next_request_can_still_begin(model, tmp_path):
    prompt = _prompt(model, 40)
    store_dir = tmp_path / "kv"
    store = specjax.open_store(model, store_dir, chunk_tokens=16)
    decode_loop.prefill(model, specjax.Connector(store), prompt, 64, save=True)
    key, offset = store.extent_of(1, K, sorted(store.stored_chunk_ids())[0])
    store.close()
    path = store_dir / key
    data = bytearray(path.read_bytes())
    data[offset + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    store = specjax.open_store(model, store_dir, chunk_tokens=16)
    try:
        conn = specjax.Connector(store)
        conn.begin(prompt)
        conn.start_load()
        conn.wait_for_layer(0)
        with pytest.raises(specjax.CorruptPrefixError, match="layer 1 failed its checksum"):
            conn.wait_for_layer(1)
        assert conn.finish() is None
        assert conn.drop_damaged(prompt) == [prompt]  # the damaged prefix is gone, to be computed and saved anew
        logits, _, reused = decode_loop.prefill(model, conn, prompt, 64, save=True)
        with store.match(prompt) as match:
            assert reused == 0 and match.length == len(prompt)
        logits, _, reused = decode_loop.prefill(model, conn, prompt, 64, save=False)
        assert reused == len(prompt) - 1
        np.testing.assert_allclose(logits, model.logits(prompt)[-1], atol=2e-5, rtol=1e-5)
    finally:
        store.close()
    assert fsck(store_dir).ok


def test_misuse_and_a_read_only_store_get_clear_errors(model, tmp_path):
    prompt = _prompt(model, 20)
    specjax.open_store(model, tmp_path / "kv", chunk_tokens=16).close()
    store = KVStore.open(tmp_path / "kv", None, read_only=True)
    try:
        conn = specjax.Connector(store)
        with pytest.raises(SpecjaxError, match="begin"):
            conn.wait_for_layer(0)
        with pytest.raises(SpecjaxError, match="at least one token"):
            conn.begin([])
        conn.begin(prompt)
        with pytest.raises(SpecjaxError, match="finish"):
            conn.begin(prompt)
        with pytest.raises(SpecjaxError, match="outside"):
            conn.wait_for_layer(model.config.num_layers)
        cfg = model.config
        kv = jnp.zeros((cfg.num_kv_heads, len(prompt), cfg.head_dim))
        with pytest.raises(StoreError, match="read-only"):
            conn.save_layer(0, kv, kv)
        k, v = conn.wait_for_layer(0)  # nothing stored: nothing to load
        assert k.shape == (cfg.num_kv_heads, 0, cfg.head_dim)
        assert conn.finish() is None
    finally:
        store.close()


def test_the_decode_loop_example_answers_as_it_would_without_the_store(tmp_path):
    served = decode_loop.main(["--store", str(tmp_path / "kv"), "--new_tokens", "3"])
    prefix = specjax.load_model("smollm2-135m").tokenizer.encode(decode_loop.PREFIX)
    assert len(served) == len(decode_loop.QUESTIONS)
    for s in served:
        assert s["same_as_without_the_store"] and s["reused"] == len(prefix) and s["disk_bytes"] > 0
