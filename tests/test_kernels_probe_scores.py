"""Probe scoring: Pallas (interpreted on CPU) vs the jnp reference vs a float64 numpy oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kernels
from specjax.kernels import probe_scores

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected|: elementwise ratios blow up near zero."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


def make_inputs(seed, probes, kv_heads, n_q, m, d, dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (probes, n_q, d), jnp.float32) * 1.5
    prefix_k = jax.random.normal(keys[1], (kv_heads, m, d), jnp.float32)
    own_k = jax.random.normal(keys[2], (kv_heads, n_q, d), jnp.float32)
    return q.astype(dtype), prefix_k.astype(dtype), own_k.astype(dtype)


def numpy_probe_scores(q, prefix_k, own_k, kv_head_of_probe, prefix_len, q_len):
    """Float64, one probe head at a time, only the valid rows and columns."""
    q, prefix_k, own_k = (np.asarray(x, np.float64) for x in (q, prefix_k, own_k))
    scale = q.shape[-1] ** -0.5
    out = np.zeros((q.shape[0], prefix_k.shape[1]))
    for p, kv in enumerate(kv_head_of_probe):
        keys = np.concatenate([prefix_k[kv, :prefix_len], own_k[kv, :q_len]])
        scores = q[p, :q_len] @ keys.T * scale
        causal = np.triu(np.ones((q_len, q_len), bool), k=1)
        scores[:, prefix_len:][causal] = -np.inf
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        out[p, :prefix_len] = weights[:, :prefix_len].sum(axis=0)
    return out


# (probes, kv_heads, kv_head_of_probe, n_q, m, prefix_len, q_len, block_q, block_k, k_splits)
PALLAS_CASES = {
    "m_not_block_multiple": (3, 2, (0, 1, 1), 13, 70, None, None, 8, 16, 2),
    "n_q_1": (3, 3, (0, 1, 2), 1, 40, None, None, 1, 16, 1),
    "padded_lengths": (2, 1, (0, 0), 16, 64, 37, 11, 8, 16, 3),
    "empty_prefix_len": (1, 1, (0,), 8, 32, 0, 8, 8, 16, 1),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", PALLAS_CASES.values(), ids=PALLAS_CASES.keys())
def test_pallas_interpret_matches_reference(case, dtype):
    probes, kv_heads, kv_map, n_q, m, prefix_len, q_len, block_q, block_k, splits = case
    q, prefix_k, own_k = make_inputs(1, probes, kv_heads, n_q, m, 32, dtype)
    args = dict(kv_head_of_probe=kv_map, prefix_len=prefix_len, q_len=q_len)
    expected = probe_scores(q, prefix_k, own_k, impl="reference", **args)
    actual = probe_scores(q, prefix_k, own_k, impl="pallas", block_q=block_q,
                          block_k=block_k, k_splits=splits, **args)
    assert actual.shape == (probes, m) and actual.dtype == jnp.float32
    if prefix_len == 0:
        np.testing.assert_array_equal(actual, 0.0)
        return
    assert rel_err(actual, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("lengths", [(None, None), (1500, 100)], ids=["full", "padded"])
def test_reference_matches_float64_oracle_on_larger_shapes(lengths):
    prefix_len, q_len = lengths
    q, prefix_k, own_k = make_inputs(2, 3, 2, 128, 2048, 64)
    kv_map = (0, 0, 1)
    actual = probe_scores(q, prefix_k, own_k, kv_head_of_probe=kv_map, prefix_len=prefix_len,
                          q_len=q_len)  # auto is the reference on CPU
    expected = numpy_probe_scores(q, prefix_k, own_k, kv_map, prefix_len or 2048, q_len or 128)
    assert rel_err(actual, expected) <= 1e-5


def test_padding_never_changes_valid_results():
    q, prefix_k, own_k = make_inputs(3, 2, 2, 9, 45, 16)
    garbage = make_inputs(4, 2, 2, 16, 64, 16)
    padded_q = garbage[0].at[:, :9].set(q)
    padded_prefix = garbage[1].at[:, :45].set(prefix_k)
    padded_own = garbage[2].at[:, :9].set(own_k)
    for impl in ("reference", "pallas"):
        exact = probe_scores(q, prefix_k, own_k, kv_head_of_probe=(0, 1), impl=impl)
        padded = probe_scores(padded_q, padded_prefix, padded_own, kv_head_of_probe=(0, 1),
                              prefix_len=45, q_len=9, impl=impl, block_q=8, block_k=16)
        assert rel_err(padded[:, :45], exact) <= 1e-6
        np.testing.assert_array_equal(padded[:, 45:], 0.0)


def test_scores_are_column_sums_of_row_softmax():
    # Each valid row's weights sum to 1, so prefix importance sums to at most q_len.
    q, prefix_k, own_k = make_inputs(5, 1, 1, 8, 32, 16)
    scores = probe_scores(q, prefix_k, own_k, kv_head_of_probe=(0,), q_len=5, impl="pallas")
    assert 0.0 < float(scores.sum()) < 5.0
    assert float(scores.min()) >= 0.0


def test_traced_lengths_under_jit():
    q, prefix_k, own_k = make_inputs(6, 2, 1, 8, 48, 16)

    @jax.jit
    def scores(prefix_len, q_len):
        return probe_scores(q, prefix_k, own_k, kv_head_of_probe=(0, 0), prefix_len=prefix_len,
                            q_len=q_len, impl="pallas", block_q=8, block_k=16)

    expected = numpy_probe_scores(q, prefix_k, own_k, (0, 0), 30, 6)
    assert rel_err(scores(30, 6), expected) <= 1e-5


def test_env_var_and_context_force_pallas_interpret(monkeypatch):
    assert not kernels.resolve_impl("auto").use_pallas  # CPU default: reference
    monkeypatch.setenv(kernels.IMPL_ENV_VAR, "pallas")
    forced = kernels.resolve_impl("auto")
    assert forced.use_pallas and forced.interpret
    assert not kernels.resolve_impl("reference").use_pallas  # explicit argument wins
    monkeypatch.delenv(kernels.IMPL_ENV_VAR)
    with kernels.kernel_impl("pallas"):
        assert kernels.resolve_impl("auto").use_pallas
    monkeypatch.setenv(kernels.IMPL_ENV_VAR, "triton")
    with pytest.raises(ValueError, match="SPECJAX_KERNEL_IMPL"):
        kernels.resolve_impl("auto")


@pytest.mark.parametrize("bad, match", [
    (dict(kv_head_of_probe=(0, 2)), "kv_head_of_probe"),
    (dict(kv_head_of_probe=(0,)), "kv_head_of_probe"),
    (dict(prefix_len=33), "prefix_len"),
    (dict(q_len=-1), "q_len"),
    (dict(block_k=24, impl="pallas"), "power of two"),
    (dict(k_splits=0, impl="pallas"), "k_splits"),
    (dict(impl="cuda"), "impl"),
])
def test_bad_arguments_raise_clear_errors(bad, match):
    q, prefix_k, own_k = make_inputs(7, 2, 2, 4, 32, 16)
    args = dict(kv_head_of_probe=(0, 1)) | bad
    with pytest.raises(ValueError, match=match):
        probe_scores(q, prefix_k, own_k, **args)


def test_wrong_shapes_raise():
    q, prefix_k, own_k = make_inputs(8, 2, 2, 4, 32, 16)
    with pytest.raises(ValueError, match="shapes disagree"):
        probe_scores(q, prefix_k, own_k[:, :3], kv_head_of_probe=(0, 1))
    with pytest.raises(ValueError, match=r"\[P, n_q, d\]"):
        probe_scores(q[0], prefix_k, own_k, kv_head_of_probe=(0, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 2048), (128, 8192 + 40), (512, 32768)],
                         ids=["nq1_2k", "nq128_8k_ragged", "nq512_32k"])
def test_gpu_compiled_matches_reference(shape, dtype):
    n_q, m = shape
    q, prefix_k, own_k = make_inputs(9, 3, 8, n_q, m, 128, dtype)
    args = dict(kv_head_of_probe=(0, 3, 7), prefix_len=m - 5, q_len=max(1, n_q - 3))
    expected = probe_scores(q, prefix_k, own_k, impl="reference", **args)
    actual = probe_scores(q, prefix_k, own_k, impl="pallas", **args)
    assert not kernels.resolve_impl("pallas").interpret
    assert rel_err(actual, expected) <= TOLERANCE[dtype]
