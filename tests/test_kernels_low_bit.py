"""Gathered attention over low-bit rows: the Pallas kernel (interpreted on a CPU) against its reference, and the
reference against the gathered attention over the decoded prefix and a float64 oracle, for every selection kind,
precision and dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels import gathered_attention, quant
from specjax.kernels.low_bit_attention import low_bit_attention, plane_order

from test_kernels_gathered_attention import (HEADS, TOLERANCE, make_inputs, numpy_attention, random_selections,
                                             rel_err)

D, GROUP = 64, 32


def _encoded(kv, bits):
    """Prefix K and V [H_kv, M, D] as encoded rows (bytes, as a store's takes hand them over), and decoded."""
    out = []
    for x in kv:
        rows = jnp.asarray(quant.encode_rows(np.asarray(x, np.float32), bits=bits, group=GROUP))
        out.append((rows, quant.decode_rows(rows, bits=bits, group=GROUP, head_dim=D)))
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])  # queries and own K/V
@pytest.mark.parametrize("kind", ["shared", "per_head", "block_table"])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pallas_low_bit_matches_its_reference(bits, kind, dtype):
    q, prefix_k, prefix_v, own_k, own_v = make_inputs(3, 13, 96, d=D, dtype=dtype)
    (k_rows, k_dec), (v_rows, v_dec) = _encoded((prefix_k, prefix_v), bits)
    selection = random_selections(np.random.default_rng(bits), 96, 48, 32)[kind]
    ref = low_bit_attention(q, k_rows, v_rows, own_k, own_v, selection, bits=bits, group=GROUP, q_len=10,
                            impl="reference")
    # the reference is the gathered attention over the decoded prefix (float32; queries and own K/V in `dtype`)
    over_decoded = gathered_attention(q, k_dec, v_dec, own_k.astype(jnp.float32), own_v.astype(jnp.float32),
                                      selection, impl="reference", q_len=10)
    assert rel_err(ref[:, :10], over_decoded[:, :10]) <= TOLERANCE[dtype]
    out = low_bit_attention(q, k_rows, v_rows, own_k, own_v, selection, bits=bits, group=GROUP, q_len=10,
                            impl="pallas", block_q=8, block_k=16, k_splits=2)
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


def test_low_bit_attention_refuses_pages_and_short_rows():
    q, prefix_k, prefix_v, own_k, own_v = make_inputs(0, 4, 32, d=D)
    (k_rows, _), (v_rows, _) = _encoded((prefix_k, prefix_v), 4)
    from specjax.kernels import SharedIndices
    sel = SharedIndices(jnp.arange(8), 8)
    with pytest.raises(ValueError, match="pages are not read at low precision"):
        low_bit_attention(q, k_rows[None], v_rows[None], own_k, own_v, sel, bits=4, group=GROUP)
    with pytest.raises(ValueError, match="hold 40-byte rows of 64 channels at 4 bits"):
        low_bit_attention(q, k_rows[..., :4], v_rows[..., :4], own_k, own_v, sel, bits=4, group=GROUP)
