"""Prefill attention (specjax.models.attention): the blocked online softmax against a float64 numpy oracle and the
materialised reference, over grouped-query heads, position offsets, unordered keys and padding; how an
implementation is chosen; and the plain forward and the engine's recompute sharing it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.engine import Engine, EngineConfig, Request, make_system
from specjax.models import attention as A
from specjax.models import inference


def numpy_attention(q, k, v, q_positions, kv_positions, kv_valid):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    heads, kv_heads, d = q.shape[0], k.shape[0], q.shape[2]
    out = np.zeros_like(q)
    visible = (np.asarray(kv_positions)[None, :] <= np.asarray(q_positions)[:, None]) & np.asarray(kv_valid)[None]
    for h in range(heads):
        kv = h // (heads // kv_heads)
        scores = q[h] @ k[kv].T / np.sqrt(d)
        scores = np.where(visible, scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out[h] = (weights / weights.sum(-1, keepdims=True)) @ v[kv]
    return out


def inputs(seed, heads, kv_heads, n_q, n_kv, d=32):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(keys[0], (heads, n_q, d)) * 2, jax.random.normal(keys[1], (kv_heads, n_kv, d)),
            jax.random.normal(keys[2], (kv_heads, n_kv, d)))


@pytest.mark.parametrize("case", ["self", "tail", "one_query", "unordered", "mha"])
def test_blocked_matches_oracle_and_reference(case):
    heads, kv_heads, n_q, n_kv = {"self": (6, 2, 300, 300), "tail": (6, 3, 45, 200), "one_query": (4, 2, 1, 130),
                                  "unordered": (6, 2, 70, 150), "mha": (4, 4, 100, 100)}[case]
    q, k, v = inputs(0, heads, kv_heads, n_q, n_kv)
    rng = np.random.default_rng(0)
    kv_positions = np.arange(n_kv)
    q_positions = np.arange(n_kv - n_q, n_kv)
    if case == "unordered":  # keys in any order: the block schedule must not assume ascending positions
        kv_positions = rng.permutation(n_kv)
    valid = np.ones(n_kv, bool)
    valid[-7:] = False  # padding after the tokens
    valid[rng.choice(n_kv - 7, 5, replace=False)] = False
    if case in ("self", "mha"):
        valid[:] = True
        valid[n_kv - 9:] = False
    expected = numpy_attention(q, k, v, q_positions, kv_positions, valid)
    args = (q, k, v, jnp.asarray(q_positions), jnp.asarray(kv_positions), jnp.asarray(valid))
    blocked = jax.jit(functools.partial(A.blocked_attention, block_q=32, block_k=16))(*args)
    reference = A.reference_attention(*args)
    rows = np.nonzero(q_positions < n_kv - 9)[0] if case in ("self", "mha") else slice(None)  # padded rows: any
    np.testing.assert_allclose(np.asarray(blocked)[:, rows], expected[:, rows], atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(blocked)[:, rows], np.asarray(reference)[:, rows], atol=1e-5, rtol=0)


def test_default_blocks_match_reference_at_length():
    """The default tiles over several blocks each way, as the model runs them."""
    q, k, v = inputs(1, 9, 3, 700, 700, d=64)
    positions = jnp.arange(700)
    valid = positions < 690
    out = jax.jit(A.attention)(q, k, v, positions, positions, valid)
    ref = A.reference_attention(q, k, v, positions, positions, valid)
    np.testing.assert_allclose(np.asarray(out)[:, :690], np.asarray(ref)[:, :690], atol=1e-5, rtol=0)


def test_schedule_visits_only_blocks_a_query_block_sees():
    """Causal prefill of 64 tokens in 16 x 16 tiles: query block i visits key blocks 0..i (10 of 16 pairs); keys
    that are all padding, or later than every query, are never visited; any key order is scheduled by position."""
    q_pos = jnp.arange(64).reshape(4, 16)
    kv_pos = jnp.arange(64).reshape(4, 16)
    valid = jnp.ones((4, 16), bool)
    schedule = A.key_block_schedule(q_pos, kv_pos, valid)
    assert schedule.visits.tolist() == [1, 2, 3, 4]
    assert schedule.order.tolist() == [0, 1, 2, 3]
    padded = A.key_block_schedule(q_pos, kv_pos, valid.at[3].set(False))
    assert padded.visits.tolist() == [1, 2, 3, 3]
    reversed_keys = A.key_block_schedule(q_pos, kv_pos[::-1], valid)
    assert reversed_keys.order.tolist() == [3, 2, 1, 0] and reversed_keys.visits.tolist() == [1, 2, 3, 4]
    tail = A.key_block_schedule(jnp.arange(48, 64)[None], kv_pos, valid)  # 16 new tokens after 48 stored
    assert tail.visits.tolist() == [4]


def test_choice_order(monkeypatch):
    monkeypatch.delenv(A.IMPL_ENV_VAR, raising=False)
    assert A.resolve_impl() == ("cudnn" if jax.default_backend() == "gpu" else "blocked")
    monkeypatch.setenv(A.IMPL_ENV_VAR, "reference")
    assert A.resolve_impl() == "reference"
    with A.attention_impl("blocked"):
        assert A.resolve_impl() == "blocked"  # context over environment
        assert A.resolve_impl("reference") == "reference"  # argument over context
    monkeypatch.setenv(A.IMPL_ENV_VAR, "flash9")
    with pytest.raises(ValueError, match="SPECJAX_ATTENTION_IMPL"):
        A.resolve_impl()
    with pytest.raises(ValueError, match="not one of"):
        A.resolve_impl("fast")


def test_cudnn_choice_off_gpu_is_blocked():
    """'cudnn' where cuDNN cannot run it (here: no GPU, or float32) computes the blocked attention."""
    q, k, v = inputs(5, 4, 2, 40, 40)
    positions = jnp.arange(40)
    for dtype in (jnp.float32, jnp.bfloat16):
        args = (q.astype(dtype), k.astype(dtype), v.astype(dtype), positions, positions)
        if jax.default_backend() == "gpu" and dtype == jnp.bfloat16:
            continue
        np.testing.assert_array_equal(np.asarray(A.attention(*args, self_causal=True, impl="cudnn"), np.float32),
                                      np.asarray(A.blocked_attention(*args), np.float32))


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama"])
def test_plain_forward_and_engine_recompute_share_the_path(name):
    """Logits of the plain forward equal the materialised reference's, and the engine's recompute (one block and
    chunked) equals the forward."""
    model = specjax.load_model(name, init="random", seed=1)
    cfg, params = model.config, model.params
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 150)
    blocked = inference.forward_logits(cfg, params, ids)
    with A.attention_impl("reference"):
        jax.clear_caches()  # the steps were traced with the default choice
        reference = inference.forward_logits(cfg, params, ids)
    jax.clear_caches()
    np.testing.assert_allclose(blocked, reference, atol=1e-5, rtol=0)
    request = Request(ids[:-1].tolist(), ids[-1:].tolist())
    for chunk in (0, 32):
        engine = Engine(model, make_system("recompute"), None, EngineConfig(prefill_chunk_tokens=chunk))
        np.testing.assert_allclose(engine.run(request).first_token_logits, blocked[-1], atol=1e-5, rtol=0)


@pytest.mark.gpu
def test_cudnn_matches_reference_in_bf16():
    q, k, v = (x.astype(jnp.bfloat16) for x in inputs(4, 8, 2, 512, 512, d=64))
    positions = jnp.arange(512)
    valid = positions < 500
    out = jax.jit(functools.partial(A.attention, self_causal=True, impl="cudnn"))(q, k, v, positions, positions, valid)
    ref = A.reference_attention(q, k, v, positions, positions, valid)
    np.testing.assert_allclose(np.asarray(out, np.float32)[:, :500], np.asarray(ref, np.float32)[:, :500], atol=3e-2)
