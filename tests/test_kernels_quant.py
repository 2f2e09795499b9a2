"""Low-bit KV (`kernels.quant`): the bytes laid out as documented (a numpy oracle), every element within half a step
of its group's scale, each group's min and max exact, and bad arguments refused."""

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels import quant as Q


def oracle_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Channel i of a byte in bits [i * bits, (i + 1) * bits), the first channel lowest."""
    per_byte = 8 // bits
    out = np.zeros(codes.shape[:-1] + (codes.shape[-1] // per_byte,), np.uint8)
    for i in range(per_byte):
        out |= (codes[..., i::per_byte].astype(np.uint8) << (i * bits)).astype(np.uint8)
    return out


def kv(seed=0, dtype=jnp.float32, shape=(3, 128, 64)):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.r_[np.ones(shape[2] - 4), 25.0 * np.ones(4)]  # a key's outlier channels
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("bits", Q.BITS)
def test_pack_lays_codes_out_as_documented_and_unpack_inverts_it(bits):
    codes = np.random.default_rng(bits).integers(0, 1 << bits, (2, 5, 32)).astype(np.uint8)
    packed = np.asarray(Q.pack(jnp.asarray(codes), bits))
    np.testing.assert_array_equal(packed, oracle_pack(codes, bits))
    np.testing.assert_array_equal(np.asarray(Q.unpack(jnp.asarray(packed), bits)), codes)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bits", Q.BITS)
@pytest.mark.parametrize("kind", ["keys", "values"])
def test_every_element_is_within_half_a_step_and_each_groups_extremes_are_exact(kind, bits, dtype):
    x = kv(bits, dtype)
    exact = np.asarray(x, np.float32)
    if kind == "keys":
        q = Q.quantize_keys(x, bits=bits, group_tokens=64)
        assert q.per_channel and q.group == 64 and q.scale.shape == (3, 2, 64)
        step = np.repeat(np.asarray(q.scale), 64, axis=1)
        groups = exact.reshape(3, 2, 64, 64)
        lo, hi = groups.min(2), groups.max(2)
    else:
        q = Q.quantize_values(x, bits=bits, group_channels=32)
        assert not q.per_channel and q.group == 32 and q.scale.shape == (3, 128, 2)
        step = np.repeat(np.asarray(q.scale), 32, axis=2)
        groups = exact.reshape(3, 128, 2, 32)
        lo, hi = groups.min(3), groups.max(3)
    assert q.codes.dtype == jnp.uint8 and q.codes.shape == (3, 128, 64 * bits // 8)
    np.testing.assert_allclose(np.asarray(q.zero), lo, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(q.scale), (hi - lo) / ((1 << bits) - 1), rtol=1e-5)
    got = np.asarray(Q.dequantize(q))
    assert got.dtype == np.float32 and got.shape == exact.shape
    assert (np.abs(got - exact) <= step / 2 * (1 + 1e-5) + 1e-6).all()
    # each group's min and max come back (codes 0 and 2**bits - 1)
    axis = 2 if kind == "keys" else 3
    back = got.reshape(groups.shape)
    np.testing.assert_allclose(back.min(axis), lo, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(back.max(axis), hi, rtol=1e-5, atol=1e-5)
    assert q.nbytes() == q.codes.size + 2 * 2 * q.scale.size


def test_a_constant_group_and_values_on_the_grid_come_back_exactly():
    x = jnp.full((2, 64, 32), 1.5, jnp.float32)
    np.testing.assert_array_equal(np.asarray(Q.dequantize(Q.quantize_keys(x, bits=2, group_tokens=16))), 1.5)
    levels = np.random.default_rng(1).integers(0, 256, (1, 8, 32))
    levels[..., 0], levels[..., 1] = 0, 255  # each token's group spans the 8-bit range: its step is 0.25 exactly
    grid = jnp.asarray(levels * 0.25 - 3.0, jnp.float32)
    back = Q.dequantize(Q.quantize_values(grid, bits=8, group_channels=32))
    np.testing.assert_allclose(np.asarray(back), np.asarray(grid), rtol=0, atol=1e-5)


@pytest.mark.parametrize("call, match", [
    (lambda: Q.quantize_keys(jnp.zeros((2, 64, 32)), bits=3, group_tokens=16), "bits=3"),
    (lambda: Q.quantize_keys(jnp.zeros((2, 60, 32)), bits=4, group_tokens=16), "not a multiple"),
    (lambda: Q.quantize_values(jnp.zeros((2, 64, 32)), bits=4, group_channels=24), "not a multiple"),
    (lambda: Q.quantize_values(jnp.zeros((64, 32)), bits=4, group_channels=32), r"\[H, T, d\]"),
    (lambda: Q.quantize_values(jnp.zeros((2, 4, 3)), bits=2, group_channels=3), "whole bytes"),
])
def test_bad_arguments_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()
