"""The GPU path without a GPU: each kernel must lower through Pallas' Triton backend (the
step that rejects unsupported ops and non-power-of-two tiles). Compiling to PTX and running
are left to the @pytest.mark.gpu tests."""

import jax
import jax.numpy as jnp
import pytest

from specjax.kernels import gathered_attention_pallas, probe_scores_pallas
from specjax.kernels.gathered_attention import packing

I32 = jax.ShapeDtypeStruct((), jnp.int32)


def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def lower_for_cuda(fn, *avals) -> str:
    try:
        return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
    except ImportError as err:  # a jaxlib built without the Triton dialect
        pytest.skip(f"Pallas Triton lowering unavailable: {err}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n_q, m, splits", [(1, 2048, 8), (128, 2088, 1)])
def test_probe_scores_lowers_to_triton(n_q, m, splits, dtype):
    def fn(q, prefix_k, own_k, prefix_len, q_len):
        return probe_scores_pallas(q, prefix_k, own_k, prefix_len, q_len,
                                   kv_head_of_probe=(0, 3, 7), scale=0.1, block_q=16,
                                   block_k=64, k_splits=splits, interpret=False)

    text = lower_for_cuda(fn, spec((3, n_q, 128), dtype), spec((8, m, 128), dtype),
                          spec((8, n_q, 128), dtype), I32, I32)
    assert text.count("xla.gpu.triton") == 2  # row statistics, then column sums


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 32], ids=["shared", "per_head"])
def test_gathered_attention_lowers_to_triton(rows, dtype):
    def fn(q, prefix_k, prefix_v, own_k, own_v, idx, count, q_len):
        return gathered_attention_pallas(q, prefix_k, prefix_v, own_k, own_v, idx, count,
                                         q_len, scale=0.1, block_q=64,
                                         block_k=64, k_splits=4, interpret=False)

    kv = spec((8, 4096, 128), dtype)
    own = spec((8, 100, 128), dtype)
    text = lower_for_cuda(fn, spec((32, 100, 128), dtype), kv, kv, own, own,
                          spec((rows, 1000), jnp.int32), spec((rows,), jnp.int32), I32)
    assert text.count("xla.gpu.triton") == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gathered_attention_over_pages_lowers_to_triton(dtype):
    """The prefix as pages [P, H_kv, C, d] read in place (a pool's, a landing buffer's)."""
    def fn(q, prefix_k, prefix_v, own_k, own_v, idx, count, q_len):
        return gathered_attention_pallas(q, prefix_k, prefix_v, own_k, own_v, idx, count,
                                         q_len, scale=0.1, block_q=64,
                                         block_k=64, k_splits=4, interpret=False)

    pages = spec((80, 4, 64, 128), dtype)
    own = spec((4, 100, 128), dtype)
    text = lower_for_cuda(fn, spec((28, 100, 128), dtype), pages, pages, own, own,
                          spec((1, 1000), jnp.int32), spec((1,), jnp.int32), I32)
    assert text.count("xla.gpu.triton") == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads, kv_heads, n_q, block_q", [(28, 4, 100, 64), (28, 4, 1, 16), (32, 8, 100, 64)],
                         ids=["qwen7b-prefill", "qwen7b-one-token", "group4"])
@pytest.mark.parametrize("layout", ["arrays", "pages"])
def test_gathered_attention_with_a_groups_heads_packed_lowers_to_triton(layout, heads, kv_heads, n_q, block_q,
                                                                        dtype):
    """A shared selection's grid over KV heads, the group's query heads packed in one tile (Qwen2.5-7B's 7 padded
    to 8: 8 tokens a tile at 64 rows, 2 at 16)."""
    pack = packing(heads, kv_heads, 1)

    def fn(q, prefix_k, prefix_v, own_k, own_v, idx, count, q_len):
        return gathered_attention_pallas(q, prefix_k, prefix_v, own_k, own_v, idx, count, q_len, scale=0.1,
                                         block_q=block_q, block_k=64, k_splits=4, interpret=False, pack=pack)

    prefix = spec((80, kv_heads, 64, 128) if layout == "pages" else (kv_heads, 5120, 128), dtype)
    own = spec((kv_heads, n_q, 128), dtype)
    text = lower_for_cuda(fn, spec((heads, n_q, 128), dtype), prefix, prefix, own, own,
                          spec((1, 1000), jnp.int32), spec((1,), jnp.int32), I32)
    assert text.count("xla.gpu.triton") == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("rows", [1, 28], ids=["shared", "per_head"])
def test_low_bit_attention_lowers_to_triton(rows, bits, dtype):
    """Qwen2.5-7B's KV shape read as a store holds it at low bits: 4,096 key-code rows per KV head with their 64-token
    chunks' ranges, and value rows (128 channels, groups of 32)."""
    from specjax.kernels.low_bit_attention import low_bit_attention_pallas
    from specjax.kernels.quant import key_range_width, row_nbytes

    def fn(q, k_codes, k_ranges, v_rows, own_k, own_v, idx, count, q_len):
        return low_bit_attention_pallas(q, k_codes, k_ranges, v_rows, own_k, own_v, idx, count, q_len, bits=bits,
                                        group=32, chunk_tokens=64, scale=0.1, block_q=64, block_k=64, k_splits=4,
                                        interpret=False)

    own = spec((4, 100, 128), dtype)
    text = lower_for_cuda(fn, spec((28, 100, 128), dtype), spec((4, 4096, 128 * bits // 8), jnp.uint8),
                          spec((4, 4096, key_range_width(128, 64)), jnp.uint8),
                          spec((4, 4096, row_nbytes(128, bits, 32)), jnp.uint8), own, own,
                          spec((rows, 1000), jnp.int32), spec((rows,), jnp.int32), I32)
    assert text.count("xla.gpu.triton") == 1
