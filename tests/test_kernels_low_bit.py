"""Gathered attention over a store's low-bit KV (key codes per chunk and channel, value rows): the Pallas kernel
(interpreted on a CPU) against its reference, and the reference against the gathered attention over the decoded prefix
and a float64 oracle, for every selection kind, precision and dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels import gathered_attention, quant
from specjax.kernels.low_bit_attention import low_bit_attention, plane_order

from test_kernels_gathered_attention import (HEADS, TOLERANCE, make_inputs, numpy_attention, random_selections,
                                             rel_err)

D, GROUP, CHUNK = 64, 32, 16


def _encoded(prefix_k, prefix_v, bits):
    """Prefix K and V [H_kv, M, D] as a store holds them (bytes, as its takes hand them over: key codes, their chunks'
    ranges, value rows) and decoded."""
    k = np.asarray(prefix_k, np.float32)
    k_codes, k_ranges = (jnp.asarray(x) for x in quant.encode_key_chunks(k, bits=bits, chunk_tokens=CHUNK))
    lo, hi = quant.key_ranges(k_ranges, head_dim=D, chunk_tokens=CHUNK)
    k_dec = quant.decode_key_codes(k_codes, lo, hi, jnp.arange(k.shape[1]) // CHUNK, bits=bits, head_dim=D)
    v_rows = jnp.asarray(quant.encode_rows(np.asarray(prefix_v, np.float32), bits=bits, group=GROUP))
    return (k_codes, k_ranges, v_rows), (k_dec, quant.decode_rows(v_rows, bits=bits, group=GROUP, head_dim=D))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])  # queries and own K/V
@pytest.mark.parametrize("kind", ["shared", "per_head", "block_table"])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pallas_low_bit_matches_its_reference(bits, kind, dtype):
    q, prefix_k, prefix_v, own_k, own_v = make_inputs(3, 13, 96, d=D, dtype=dtype)
    stored, (k_dec, v_dec) = _encoded(prefix_k, prefix_v, bits)
    # the store's bytes arrive in its element type: the keys' codes as uint8, the rest as float32 words
    stored = (stored[0], *(jax.lax.bitcast_convert_type(x.reshape(x.shape[:2] + (-1, 4)), jnp.float32)
                           for x in stored[1:]))
    selection = random_selections(np.random.default_rng(bits), 96, 48, 32)[kind]
    ref = low_bit_attention(q, *stored, own_k, own_v, selection, bits=bits, group=GROUP, chunk_tokens=CHUNK,
                            q_len=10, impl="reference")
    # the reference is the gathered attention over the decoded prefix (float32; queries and own K/V in `dtype`)
    over_decoded = gathered_attention(q, k_dec, v_dec, own_k.astype(jnp.float32), own_v.astype(jnp.float32),
                                      selection, impl="reference", q_len=10)
    assert rel_err(ref[:, :10], over_decoded[:, :10]) <= TOLERANCE[dtype]
    out = low_bit_attention(q, *stored, own_k, own_v, selection, bits=bits, group=GROUP, chunk_tokens=CHUNK,
                            q_len=10, impl="pallas", block_q=8, block_k=16, k_splits=2)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_err(out[:, :10], ref[:, :10]) <= TOLERANCE[dtype]
    idx, count = selection.token_indices(HEADS)
    tokens = [np.asarray(idx[h if idx.shape[0] > 1 else 0])[:int(count[h if count.shape[0] > 1 else 0])]
              for h in range(HEADS)]
    oracle = numpy_attention(q, k_dec, v_dec, own_k, own_v, tokens, 10)
    assert rel_err(out[:, :10], oracle) <= TOLERANCE[dtype]


def test_plane_order_puts_each_bytes_codes_in_planes():
    order = plane_order(8, 4)  # 2 codes a byte: channels 0, 2, 4, 6 then 1, 3, 5, 7
    np.testing.assert_array_equal(order, [0, 2, 4, 6, 1, 3, 5, 7])
    np.testing.assert_array_equal(plane_order(8, 8), np.arange(8))


def test_low_bit_attention_refuses_pages_short_rows_and_partial_chunks():
    q, prefix_k, prefix_v, own_k, own_v = make_inputs(0, 4, 32, d=D)
    (k_codes, k_ranges, v_rows), _ = _encoded(prefix_k, prefix_v, 4)
    from specjax.kernels import SharedIndices
    sel = SharedIndices(jnp.arange(8), 8)
    kw = dict(bits=4, group=GROUP, chunk_tokens=CHUNK)
    with pytest.raises(ValueError, match="pages are not read at low precision"):
        low_bit_attention(q, k_codes[None], k_ranges, v_rows, own_k, own_v, sel, **kw)
    with pytest.raises(ValueError, match="v_rows .* rows of at least 40 bytes"):
        low_bit_attention(q, k_codes, k_ranges, v_rows[..., :32], own_k, own_v, sel, **kw)
    with pytest.raises(ValueError, match="k_ranges .* rows of at least 16 bytes"):
        low_bit_attention(q, k_codes, k_ranges[..., :8], v_rows, own_k, own_v, sel, **kw)
    with pytest.raises(ValueError, match="32 prefix tokens are not whole chunks of 24"):
        low_bit_attention(q, k_codes, k_ranges, v_rows, own_k, own_v, sel, bits=4, group=GROUP, chunk_tokens=24)
