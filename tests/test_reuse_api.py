"""The Python API for prefix-KV reuse (`specjax.reuse`, exported from `specjax`) and the serving loop in `examples/`."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import specjax
from specjax.errors import SpecjaxError
from specjax.stores import StoreMismatchError

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model():
    return specjax.load_model("tiny-llama", init="random", seed=3)


def _request(model, seed=0, prefix_len=40, query_len=6):
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    prefix = rng.integers(0, vocab, 200).tolist()[:prefix_len]
    return specjax.Request(prefix, rng.integers(0, vocab, query_len).tolist(),
                           [rng.integers(0, vocab, 3).tolist()])


def test_a_stored_prefix_is_reused_and_gives_recomputes_answer(model, tmp_path):
    store = specjax.open_store(model, tmp_path / "kv", chunk_tokens=16)
    try:
        engine = specjax.prefill_engine(model, "as_full", store, retention=1.0)
        request = _request(model)
        assert engine.warm(request.prefix) and not engine.warm(request.prefix)  # stored once
        assert specjax.warm_up(engine, [request]) > 0
        reused = engine.run(_request(model))
    finally:
        store.close()
    plain = specjax.prefill_engine(model, "recompute").run(_request(model))
    assert reused.reused_tokens == 40 and plain.reused_tokens == 0
    np.testing.assert_allclose(reused.first_token_logits, plain.first_token_logits, atol=2e-4)
    np.testing.assert_allclose([lp for lp, _ in reused.continuation_logprobs],
                               [lp for lp, _ in plain.continuation_logprobs], atol=2e-4)


def test_a_warmed_up_shape_compiles_nothing_more(model, tmp_path):
    from specjax.compiles import CompileCounter

    store = specjax.open_store(model, tmp_path / "kv", system="spec")
    try:
        engine = specjax.prefill_engine(model, "spec", store, retention=0.5, options={"alpha": 0.8})
        assert engine.system.alpha == 0.8
        engine.warm(_request(model).prefix)
        specjax.warm_up(engine, [_request(model)])
        with CompileCounter() as compiles:
            result = engine.run(_request(model, seed=0))
    finally:
        store.close()
    assert compiles.count == 0 and result.reused_tokens == 40


def test_a_store_of_another_model_or_chunk_is_refused(model, tmp_path):
    specjax.open_store(model, tmp_path / "kv", chunk_tokens=16).close()
    with pytest.raises(StoreMismatchError, match="chunk_tokens: store=16 model=64"):
        specjax.open_store(model, tmp_path / "kv")
    other = specjax.load_model("tiny-llama", init="random", seed=4)
    with pytest.raises(StoreMismatchError, match="holds the KV of"):
        specjax.open_store(other, tmp_path / "kv", chunk_tokens=16)


@pytest.mark.parametrize("name", ["cacheblend", "full_reuse"])
def test_a_store_for_cacheblend_records_its_chunk_protocol(tmp_path, name):
    """open_store(system=) makes the store the system runs over: CacheBlend's chunks are written after a sink token,
    which its fingerprint names (an engine refuses a store without it)."""
    base = specjax.load_model("tiny-llama", init="random", seed=3)
    model = specjax.Model("tiny-llama-bos", dataclasses.replace(base.config, bos_token_id=1), base.params, "random")
    store = specjax.open_store(model, tmp_path / "kv", system=name)
    try:
        assert store.fingerprint["chunk_sink"] == [1]
        assert specjax.prefill_engine(model, name, store).store is store
    finally:
        store.close()


def test_the_chunk_follows_the_system_that_needs_its_own():
    assert specjax.reuse.chunk_tokens_of("contiguous_kv") == 16
    assert specjax.reuse.chunk_tokens_of("spec") == 64
    assert specjax.reuse.chunk_tokens_of("spec", 32) == 32
    with pytest.raises(SpecjaxError, match="unknown system 'nope'"):
        specjax.reuse.chunk_tokens_of("nope")


def test_a_reusing_system_without_a_store_is_refused(model):
    with pytest.raises(SpecjaxError, match="give it a store"):
        specjax.prefill_engine(model, "spec")


def test_the_serving_example_reuses_its_prefix_and_compiles_nothing_while_serving(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "serve_prefix.py"), "--store", str(tmp_path / "kv")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("prefix of ") and lines[0].endswith(" tokens stored")
    prefix_tokens = int(lines[0].split()[2])
    served = [line for line in lines if " TTFT " in line]
    assert len(served) == 4 and all(f"reused {prefix_tokens} tokens" in line for line in served)
    assert [line.split()[0] for line in served] == ["positive", "negative", "positive", "negative"]
    assert lines[-1] == "compiled while serving: 0"


def test_the_readmes_reuse_example_runs(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    blocks = [b.split("\n", 1)[1] for b in readme.split("```")[1::2] if b.startswith("python\n")]
    (example,) = [b for b in blocks if "specjax.open_store" in b]
    monkeypatch.chdir(tmp_path)
    from specjax.compiles import CompileCounter

    namespace = {}
    with CompileCounter() as compiles:
        exec(compile(example, "README.md", "exec"), namespace)
    result, prefix = namespace["result"], namespace["prefix"]
    assert result.reused_tokens == len(prefix) > 100 and len(result.continuation_logprobs) == 1
    assert (tmp_path / "kv-store").is_dir() and compiles.count > 0
