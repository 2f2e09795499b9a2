"""benchmarks/attention_error.py: its attention is the reference attention, its predicted rounding bias is the measured
one, and on the real smollm2-135m its exact chain is the model and fewer bits move the attention more."""

import json
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import bench_scripts  # tests/bench_scripts.py
from specjax.kernels import SharedIndices
from specjax.kernels.gathered_attention import gathered_attention_reference

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
ae = bench_scripts.load("attention_error.py", "attention_error_bench")


def _layer(seed=0, kv_heads=2, group=2, n=8, m=512, d=32, q_scale=1.0):
    rng = np.random.default_rng(seed)
    channel = rng.uniform(0.2, 3.0, d)  # keys whose channels differ in size, as a model's do
    q = rng.normal(size=(kv_heads, group, n, d)) * q_scale
    k = rng.normal(size=(kv_heads, m, d)) * channel
    v = rng.normal(size=(kv_heads, m, d))
    own_k, own_v = rng.normal(size=(kv_heads, n, d)) * channel, rng.normal(size=(kv_heads, n, d))
    return ae.Layer(q, k, v, own_k, own_v, d ** -0.5, choosing=n // 2)


def test_exact_output_is_the_kernels_reference_attention():
    layer = _layer()
    kv, g, n, d = layer.q.shape
    m = layer.k.shape[1]
    q = layer.q.reshape(kv * g, n, d)
    want = gathered_attention_reference(*(jnp.asarray(x, jnp.float32) for x in (q, layer.k, layer.v, layer.own_k,
                                                                               layer.own_v)),
                                        SharedIndices(jnp.arange(m), m))
    got = layer.output(layer.s, layer.v).reshape(kv * g, n, d)
    np.testing.assert_allclose(got, np.asarray(want), rtol=2e-4, atol=2e-5)
    assert np.all(layer.error(layer.o) == 0)
    kept = np.zeros((kv, 1, m), bool)
    kept[:, :, 7:40] = True
    want = gathered_attention_reference(*(jnp.asarray(x, jnp.float32) for x in (q, layer.k, layer.v, layer.own_k,
                                                                               layer.own_v)),
                                        SharedIndices(jnp.arange(7, 40), 33))
    np.testing.assert_allclose(layer.output(layer.s, layer.v, kept).reshape(kv * g, n, d), np.asarray(want),
                               rtol=2e-4, atol=2e-5)


def test_rounding_bias_of_the_softmax_mass_is_var_over_two_and_the_correction_removes_it():
    layer = _layer(kv_heads=4, n=32, m=4096)  # the mass a sum over many rows, for many queries
    keys, noise, _ = ae.encoded(layer.k.astype(np.float32), layer.v.astype(np.float32), 4, 64, 32)
    s, var = layer.scores(keys), layer.variance(noise)
    every = np.ones(layer.k.shape[:2], bool)
    bias, predicted = layer.mass_bias(s, every).mean(), ae.mean_over(var / 2, every)
    assert predicted > 0.01
    assert bias == pytest.approx(predicted, rel=0.3)
    assert abs(layer.mass_bias(s - var / 2, every).mean()) < 0.25 * predicted
    exact_keys = ae.encoded(layer.k.astype(np.float32), layer.v.astype(np.float32), 8, 64, 32)
    assert ae.mean_over(layer.variance(exact_keys[1]), every) < predicted / 100  # 8 bits: (15 / 255)^2 of it


def test_fewer_bits_and_dropping_err_more_and_every_row_kept_is_exact():
    layer = _layer()
    codes = {b: ae.encoded(layer.k.astype(np.float32), layer.v.astype(np.float32), b, 64, 32) for b in (8, 4, 2)}
    into = {}
    ae.measure_layer(layer, ae.variants(layer, codes, [8, 4, 2], 8, (4, 4), 0.25), into)
    err = {name: np.concatenate(r["error"]).mean() for name, r in into.items()}
    assert err["KV8"] < err["KV4"] < err["KV2"]
    assert err["K4"] < err["KV4"] and err["V4"] < err["KV4"]
    assert err["mixed"] < err["KV4"] and err["mixed shared"] < err["KV4"]
    assert err["mixed"] < err["drop"]
    keys8 = {}  # the rest's keys at 8 bits, its values at 4
    ae.measure_layer(layer, ae.variants(layer, codes, [8], 8, (8, 4), 0.25), keys8)
    assert np.concatenate(keys8["mixed"]["error"]).mean() < err["mixed"]
    assert np.concatenate(keys8["mixed"]["error"]).mean() > np.concatenate(into["KV8"]["error"]).mean()
    whole = {}
    ae.measure_layer(layer, ae.variants(layer, codes, [8, 4], 8, (4, 4), 1.0), whole)
    assert np.concatenate(whole["drop"]["error"]).max() == 0.0
    np.testing.assert_allclose(np.concatenate(whole["mixed"]["error"]), np.concatenate(whole["KV8"]["error"]))


def test_engine_sets_shared_and_per_head():
    """spec_mixed's rows at the selection's bits are whole chunks (here of 2 tokens): those its set touches."""
    keep, keys_at, values_at = ae.engine_keep(np.array([[3, 1]]), kv_heads=2, group=3, m=7, chunk_tokens=2)
    assert keep.shape == (2, 1, 7) and keep[:, 0].tolist() == [[False, True, False, True, False, False, False]] * 2
    whole = [True, True, True, True, False, False, False]
    assert keys_at.tolist() == values_at.tolist() == [whole] * 2
    per_head = np.array([[0], [1], [1], [2], [2], [6]])  # 6 query heads over 2 KV heads, one row each
    keep, keys_at, values_at = ae.engine_keep(per_head, kv_heads=2, group=3, m=7, chunk_tokens=2)
    assert keep.shape == (2, 3, 7) and keep[1, 2].tolist() == [False] * 6 + [True]
    assert keys_at.all()  # a fallback layer loads every key at the selection's bits
    # the union's values' chunks: rows 0-3 and 6
    assert values_at[0].tolist() == values_at[1].tolist() == [True, True, True, True, False, False, True]


@pytest.mark.skipif(not (DATA / "piqa").exists(), reason="needs the PIQA files of docs/data.md")
def test_on_the_real_model_the_exact_chain_is_the_model_and_fewer_bits_err_more(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention_error.py"), "--task", "piqa",
                    "--requests", "1",
                    "--prefix_tokens", "256", "--bits", "8,4", "--chains", "KV8,KV4,mixed engine", "--data_dir",
                    str(DATA), "--out", str(tmp_path)], check=True, cwd=ROOT, timeout=900)
    out = json.loads((tmp_path / "attention_error.json").read_text())
    assert (tmp_path / "attention_error.md").read_text().startswith("# smollm2-135m")
    v = out["variants"]
    assert v["KV8"]["error"] < v["KV4"]["error"] and v["mixed engine"]["error"] < v["KV4"]["error"]
    assert 0 < v["KV8"]["logprob_change_abs"] < v["KV4"]["logprob_change_abs"]
    assert len(v["mixed engine"]["logprob_change"]) == 1 and "logprob_change" not in v["V4"]
    refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention_error.py"), "--chains", "KV3"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "no variant 'KV3'" in refused.stderr + refused.stdout
