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


# -- keys per chunk and channel, as a store holds them ------------------------------------------------------------

def _key_chunks_oracle(k, bits, chunk_tokens):
    """numpy, element by element: each chunk's per-channel float16 range (rounded outwards), the codes against it."""
    heads, tokens, d = k.shape
    levels = (1 << bits) - 1
    codes = np.zeros(k.shape, np.uint8)
    lo16 = np.zeros((heads, tokens // chunk_tokens, d), np.float16)
    hi16 = np.zeros_like(lo16)
    for h in range(heads):
        for c in range(tokens // chunk_tokens):
            for j in range(d):
                x = k[h, c * chunk_tokens:(c + 1) * chunk_tokens, j]
                lo, hi = np.float16(x.min()), np.float16(x.max())
                lo = np.nextafter(lo, np.float16(-np.inf)) if np.float32(lo) > x.min() else lo
                hi = np.nextafter(hi, np.float16(np.inf)) if np.float32(hi) < x.max() else hi
                lo16[h, c, j], hi16[h, c, j] = lo, hi
                step = (np.float32(hi) - np.float32(lo)) / np.float32(levels)
                codes[h, c * chunk_tokens:(c + 1) * chunk_tokens, j] = np.clip(
                    np.rint((x - np.float32(lo)) / (step if step > 0 else np.float32(1))), 0, levels)
    return codes, lo16, hi16


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_key_chunks_are_codes_against_each_chunks_channel_range_spread_over_its_rows(bits):
    """`encode_key_chunks`' codes are the oracle's, packed as `pack` packs them; each chunk's range block (d float16
    minima, then d maxima, zero bytes after) lies over its rows, `key_range_width` bytes a row; `key_ranges` reads
    it back and `decode_key_codes` puts every key within half its channel's step, each row against its own chunk's
    range as `chunk_of_row` says, in any order."""
    rng = np.random.default_rng(bits)
    k = rng.normal(size=(2, 48, 16)).astype(np.float32) * 3
    k[:, :, 5] += 40  # an outlier channel keeps a range of its own
    k[1, 16:32, 2] = 0.75  # a constant channel of a chunk (float16 exact): step 0, every code 0, the value its minimum
    codes, ranges = Q.encode_key_chunks(k, bits=bits, chunk_tokens=16)
    want_codes, lo16, hi16 = _key_chunks_oracle(k, bits, 16)
    np.testing.assert_array_equal(codes, np.asarray(Q.pack(jnp.asarray(want_codes), bits)))
    width = Q.key_range_width(16, 16)
    assert width == 4 and ranges.shape == (2, 48, 4) and ranges.dtype == np.uint8
    block = ranges.reshape(2, 3, 16 * width)
    np.testing.assert_array_equal(block[..., :32].view(np.float16), lo16)
    np.testing.assert_array_equal(block[..., 32:64].view(np.float16), hi16)
    lo, hi = Q.key_ranges(jnp.asarray(ranges), head_dim=16, chunk_tokens=16)
    np.testing.assert_array_equal(np.asarray(lo), lo16.astype(np.float32))
    order = rng.permutation(48)  # rows as a take may give them: any order, each with its chunk's index
    back = np.asarray(Q.decode_key_codes(jnp.asarray(codes[:, order]), lo, hi, jnp.asarray(order // 16), bits=bits,
                                         head_dim=16))
    step = np.repeat((hi16.astype(np.float32) - lo16.astype(np.float32)) / ((1 << bits) - 1), 16, axis=1)[:, order]
    assert (np.abs(back - k[:, order]) <= 0.5 * step * 1.0001 + 1e-6).all()
    np.testing.assert_array_equal(back[1][(order >= 16) & (order < 32), 2], 0.75)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_a_chunks_padding_rows_are_left_out_of_its_range(bits):
    """A segment's last chunk is padded after its last token: the padding (zeros) must not stretch the range of a
    channel whose keys keep one sign, so the codes of the tokens are those of the tokens alone; padding codes 0."""
    rng = np.random.default_rng(bits)
    k = rng.uniform(5, 6, size=(2, 32, 16)).astype(np.float32)
    k[:, 20:] = 0  # 12 rows of padding in the second chunk
    keys = np.arange(32) < 20
    codes, ranges = Q.encode_key_chunks(k, bits=bits, chunk_tokens=16, keys=keys)
    alone, alone_ranges = Q.encode_key_chunks(np.concatenate([k[:, :20], k[:, 16:20], k[:, 16:20], k[:, 16:20]],
                                                             axis=1), bits=bits, chunk_tokens=16)
    np.testing.assert_array_equal(codes[:, :20], alone[:, :20])  # the second chunk's four tokens, repeated
    np.testing.assert_array_equal(ranges, alone_ranges)
    assert not codes[:, 20:].any()
    lo, _ = Q.key_ranges(jnp.asarray(ranges), head_dim=16, chunk_tokens=16)
    assert (np.asarray(lo) >= 4.99).all()  # not stretched to 0
    empty, empty_ranges = Q.encode_key_chunks(k, bits=bits, chunk_tokens=16, keys=np.arange(32) < 16)
    np.testing.assert_array_equal(np.asarray(Q.key_ranges(jnp.asarray(empty_ranges), head_dim=16,
                                                          chunk_tokens=16)[1])[:, 1], 0)  # no keys: range 0..0
    with pytest.raises(ValueError, match="whether it is a key"):
        Q.encode_key_chunks(k, bits=bits, chunk_tokens=16, keys=keys[:20])


def test_key_chunks_refuse_what_they_cannot_encode():
    with pytest.raises(ValueError, match="in chunks of 16 tokens"):
        Q.encode_key_chunks(np.zeros((1, 40, 16), np.float32), bits=4, chunk_tokens=16)
    with pytest.raises(ValueError, match="beyond float16's range"):
        Q.encode_key_chunks(np.full((1, 16, 16), 1e6, np.float32), bits=4, chunk_tokens=16)
    assert Q.key_range_width(128, 64) == 8 and Q.key_range_width(64, 48) == 6  # 256 bytes over 48 rows: 6 a row
