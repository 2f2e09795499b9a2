"""Gathered attention: Pallas (interpreted on CPU) vs the jnp reference vs float64 numpy, for
shared, per-head and block-table selections, with grouped-query heads and padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels import (
    BlockTable,
    PerHeadIndices,
    SharedIndices,
    gathered_attention,
    gathered_attention_pallas,
)
from specjax.kernels.gathered_attention import packing

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected|: elementwise ratios blow up near zero."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


def make_inputs(seed, n_q, tokens, heads=HEADS, kv_heads=KV_HEADS, d=HEAD_DIM,
                dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(keys[0], (heads, n_q, d)) * 1.5
    kv = [jax.random.normal(k, (kv_heads, size, d)) for k, size in
          zip(keys[1:], (tokens, tokens, n_q, n_q))]
    return [x.astype(dtype) for x in (q, *kv)]


def numpy_attention(q, prefix_k, prefix_v, own_k, own_v, tokens_of_head, q_len):
    """Float64 oracle: head h attends to prefix tokens tokens_of_head[h] + own 0..i."""
    q, prefix_k, prefix_v, own_k, own_v = (np.asarray(x, np.float64)
                                           for x in (q, prefix_k, prefix_v, own_k, own_v))
    heads, _, d = q.shape
    group = heads // prefix_k.shape[0]
    out = np.zeros((heads, q_len, d))
    for h in range(heads):
        g, tokens = h // group, np.asarray(tokens_of_head[h], int)
        keys = np.concatenate([prefix_k[g, tokens], own_k[g, :q_len]])
        values = np.concatenate([prefix_v[g, tokens], own_v[g, :q_len]])
        scores = q[h, :q_len] @ keys.T * d ** -0.5
        scores[:, len(tokens):][np.triu(np.ones((q_len, q_len), bool), k=1)] = -np.inf
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        out[h] = weights @ values
    return out


def random_selections(rng, tokens, capacity, count):
    """The three selection kinds, each with `count` valid entries of `capacity`."""
    shared = rng.permutation(tokens)[:capacity]
    per_head = np.stack([rng.permutation(tokens)[:capacity] for _ in range(HEADS)])
    chunks = rng.permutation(tokens // 16)[: capacity // 16]
    return {
        "shared": SharedIndices(jnp.asarray(shared), count),
        "per_head": PerHeadIndices(jnp.asarray(per_head), count),
        "block_table": BlockTable(jnp.asarray(chunks), count // 16, chunk_tokens=16),
    }


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", ["shared", "per_head", "block_table"])
def test_pallas_interpret_matches_reference(kind, dtype):
    # 13 query rows (10 valid), 48 selected of 64 slots (32 valid): nothing is block-aligned.
    q, *kv = make_inputs(1, 13, 96, dtype=dtype)
    selection = random_selections(np.random.default_rng(1), 96, 48, 32)[kind]
    expected_out = gathered_attention(q, *kv, selection, impl="reference", q_len=10)
    out = gathered_attention(q, *kv, selection, impl="pallas", q_len=10, block_q=8, block_k=16, k_splits=2)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_err(out[:, :10], expected_out[:, :10]) <= TOLERANCE[dtype]


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_matches_float64_oracle_with_per_head_sets(impl):
    q, *kv = make_inputs(2, 9, 40)
    rng = np.random.default_rng(2)
    per_head = np.stack([rng.permutation(40)[:12] for _ in range(HEADS)])
    out = gathered_attention(q, *kv, PerHeadIndices(jnp.asarray(per_head), 7), q_len=6, impl=impl,
                             block_q=4, block_k=4)
    expected_out = numpy_attention(q, *kv, per_head[:, :7], 6)
    assert rel_err(out[:, :6], expected_out) <= 1e-5


def test_n_q_1_pallas():
    q, *kv = make_inputs(3, 1, 50)
    selection = SharedIndices(jnp.asarray([49, 3, 17, 0, 22]))
    out = gathered_attention(q, *kv, selection, impl="pallas", block_q=1, block_k=4)
    expected = numpy_attention(q, *kv, [[49, 3, 17, 0, 22]] * HEADS, 1)
    assert rel_err(out, expected) <= 1e-5


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_selecting_everything_equals_dense_attention(impl):
    q, prefix_k, prefix_v, own_k, own_v = make_inputs(4, 12, 37)
    everything = SharedIndices(jnp.arange(37))
    out = gathered_attention(q, prefix_k, prefix_v, own_k, own_v, everything, impl=impl, block_q=8, block_k=16)
    # Dense: prefix + own keys with a causal mask offset by the prefix length.
    keys = jnp.repeat(jnp.concatenate([prefix_k, own_k], axis=1), 2, axis=0)
    values = jnp.repeat(jnp.concatenate([prefix_v, own_v], axis=1), 2, axis=0)
    mask = jnp.arange(37 + 12)[None, :] <= jnp.arange(12)[:, None] + 37
    dense = jax.nn.dot_product_attention(q.transpose(1, 0, 2)[None], keys.transpose(1, 0, 2)[None],
                                         values.transpose(1, 0, 2)[None], mask=mask[None, None])
    assert rel_err(out, dense[0].transpose(1, 0, 2)) <= 1e-5


@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize("empty", ["count_zero", "no_entries", "no_blocks", "no_tokens"])
def test_empty_selection_is_causal_self_attention(impl, empty):
    q, *kv = make_inputs(5, 8, 0 if empty == "no_tokens" else 32)
    selection = {
        "count_zero": SharedIndices(jnp.asarray([5, 1, 9]), 0),
        "no_entries": SharedIndices(jnp.zeros((0,), jnp.int32)),
        "no_blocks": BlockTable(jnp.zeros((0,), jnp.int32), chunk_tokens=16),
        "no_tokens": PerHeadIndices(jnp.zeros((HEADS, 0), jnp.int32)),
    }[empty]
    out = gathered_attention(q, *kv, selection, impl=impl, block_q=4, block_k=4)
    expected = numpy_attention(q, *kv, [[]] * HEADS, 8)
    assert rel_err(out, expected) <= 1e-5


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_padding_never_changes_valid_rows(impl):
    q, *kv = make_inputs(6, 7, 64)
    bigger_q, *bigger_kv = make_inputs(7, 16, 64)
    padded_q = bigger_q.at[:, :7].set(q)
    padded_kv = [big.at[:, :7].set(x) if x.shape[1] == 7 else x
                 for big, x in zip(bigger_kv, kv)]
    # Entries past `count` are padding: anything, even out of range, must be ignored.
    chosen = jnp.asarray([40, 2, 63, 11, 30])
    padded_idx = jnp.concatenate([chosen, jnp.asarray([1000, -5, 40])])
    exact = gathered_attention(q, *kv, SharedIndices(chosen), impl=impl, block_q=4,
                               block_k=4)
    padded = gathered_attention(padded_q, *padded_kv, SharedIndices(padded_idx, 5), q_len=7,
                                impl=impl, block_q=4, block_k=4)
    assert rel_err(padded[:, :7], exact) <= 1e-6
    assert bool(jnp.all(jnp.isfinite(padded)))  # padded rows feed later layers' V


def test_traced_selection_and_lengths_under_jit():
    q, *kv = make_inputs(8, 8, 48)
    idx = jnp.asarray([47, 0, 5, 6, 20, 33, 12, 1])

    @jax.jit
    def attend(idx, count, q_len):
        return gathered_attention(q, *kv, SharedIndices(idx, count), q_len=q_len, impl="pallas", block_q=4,
                                  block_k=4)

    out = attend(idx, 6, 5)
    expected_out = numpy_attention(q, *kv, [np.asarray(idx[:6])] * HEADS, 5)
    assert rel_err(out[:, :5], expected_out) <= 1e-5


def as_pages(prefix, chunk_tokens=16):
    """[H_kv, M, d] as pages [M / C, H_kv, C, d]: token t is row t % C of page t // C."""
    kv_heads, tokens, d = prefix.shape
    return prefix.reshape(kv_heads, tokens // chunk_tokens, chunk_tokens, d).transpose(1, 0, 2, 3)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize("kind", ["shared", "per_head", "block_table"])
def test_pages_read_in_place_equal_the_same_tokens_as_arrays(kind, impl):
    """Pages [P, H_kv, C, d] (a pool's or a landing buffer's) give what the same tokens give as [H_kv, M, d],
    for every selection kind (a block table's blocks are page numbers), and the float64 oracle; rows that no
    selection counts hold NaN there and change nothing."""
    q, prefix_k, prefix_v, own_k, own_v = make_inputs(12, 13, 96)
    selection = random_selections(np.random.default_rng(12), 96, 48, 32)[kind]
    idx, count = selection.token_indices(HEADS)
    counted = np.zeros(96, bool)
    for row, n in zip(np.atleast_2d(np.asarray(idx)), np.broadcast_to(np.asarray(count), (idx.shape[0],))):
        counted[row[:n]] = True
    poisoned_k, poisoned_v = (jnp.where(jnp.asarray(counted)[None, :, None], x, jnp.nan)
                              for x in (prefix_k, prefix_v))
    args = dict(q_len=10, impl=impl)
    if impl == "pallas":
        args.update(block_q=8, block_k=16, k_splits=2)
    as_arrays = gathered_attention(q, prefix_k, prefix_v, own_k, own_v, selection, **args)
    in_pages = gathered_attention(q, as_pages(poisoned_k), as_pages(poisoned_v), own_k, own_v, selection, **args)
    assert bool(jnp.all(jnp.isfinite(in_pages)))
    assert rel_err(in_pages, as_arrays) <= 1e-6
    rows = np.broadcast_to(np.atleast_2d(np.asarray(idx)), (HEADS, idx.shape[1]))
    counts = np.broadcast_to(np.asarray(count), (HEADS,))
    expected_out = numpy_attention(q, prefix_k, prefix_v, own_k, own_v, [rows[h, :counts[h]] for h in range(HEADS)], 10)
    assert rel_err(in_pages[:, :10], expected_out) <= TOLERANCE[jnp.float32]


@pytest.mark.parametrize("heads, kv_heads, pack", [(3, 3, 1), (6, 2, 4), (7, 1, 8)])
@pytest.mark.parametrize("layout", ["arrays", "pages"])
@pytest.mark.parametrize("kind", ["shared", "block_table"])
def test_a_groups_query_heads_packed_in_one_tile_equal_a_tile_per_head(kind, layout, heads, kv_heads, pack):
    """With one selection for every head, a KV head's query heads share its tiles (`packing`: the group rounded up to
    a power of two, the rest zero heads): the grid over KV heads gives what the grid over query heads gives, and the
    reference, for groups of 1, 3 and 7 heads, on arrays and on pages."""
    q, prefix_k, prefix_v, own_k, own_v = make_inputs(14, 13, 96, heads=heads, kv_heads=kv_heads)
    rng = np.random.default_rng(14)
    selection = {"shared": SharedIndices(jnp.asarray(rng.permutation(96)[:48]), 37),
                 "block_table": BlockTable(jnp.asarray(rng.permutation(6)[:4]), 3, chunk_tokens=16)}[kind]
    if layout == "pages":
        prefix_k, prefix_v = as_pages(prefix_k), as_pages(prefix_v)
    idx, count = selection.token_indices(heads)
    assert packing(heads, kv_heads, idx.shape[0]) == pack
    tiles = dict(scale=HEAD_DIM ** -0.5, block_k=16, k_splits=2, interpret=True)
    args = (q, prefix_k, prefix_v, own_k, own_v, idx, count, jnp.int32(10))
    per_head = gathered_attention_pallas(*args, block_q=8, pack=1, **tiles)
    packed = gathered_attention_pallas(*args, block_q=8 * pack, pack=pack, **tiles)
    expected_out = gathered_attention(q, prefix_k, prefix_v, own_k, own_v, selection, impl="reference", q_len=10)
    assert packed.shape == per_head.shape == q.shape
    assert rel_err(packed[:, :10], per_head[:, :10]) <= 1e-6
    assert rel_err(packed[:, :10], expected_out[:, :10]) <= TOLERANCE[jnp.float32]
    public = gathered_attention(q, prefix_k, prefix_v, own_k, own_v, selection, impl="pallas", q_len=10)
    assert rel_err(public[:, :10], expected_out[:, :10]) <= TOLERANCE[jnp.float32]


def test_packing_refuses_what_cannot_share_a_tile():
    """A per-head selection keeps a tile per query head; a pack that cannot hold the group, or does not divide the
    tile, or meets a selection per head is refused."""
    assert packing(6, 2, 6) == 1 and packing(6, 2, 1) == 4 and packing(2, 2, 1) == 1
    q, *kv = make_inputs(15, 4, 32, heads=6, kv_heads=2)
    idx, count = SharedIndices(jnp.asarray([1, 2])).token_indices(6)
    tiles = dict(scale=0.1, block_k=4, k_splits=1, interpret=True)
    with pytest.raises(ValueError, match="group of at most 2"):
        gathered_attention_pallas(q, *kv, idx, count, jnp.int32(4), block_q=8, pack=2, **tiles)
    with pytest.raises(ValueError, match="multiple of it"):
        gathered_attention_pallas(q, *kv, idx, count, jnp.int32(4), block_q=2, pack=4, **tiles)
    rows, rows_count = PerHeadIndices(jnp.asarray([[1, 2]] * 6)).token_indices(6)
    with pytest.raises(ValueError, match="one shared selection row"):
        gathered_attention_pallas(q, *kv, rows, rows_count, jnp.int32(4), block_q=8, pack=4, **tiles)


def test_pages_with_a_block_table_out_of_range_or_disagreeing_shapes_raise():
    q, prefix_k, prefix_v, own_k, own_v = make_inputs(13, 4, 64)
    pages_k, pages_v = as_pages(prefix_k), as_pages(prefix_v)  # 4 pages of 16 tokens
    with pytest.raises(ValueError, match="out of range"):
        gathered_attention(q, pages_k, pages_v, own_k, own_v, BlockTable(jnp.asarray([1, 4]), chunk_tokens=16))
    with pytest.raises(ValueError, match="shapes disagree"):
        gathered_attention(q, pages_k, pages_v[:, :1], own_k, own_v, SharedIndices(jnp.asarray([1, 2])))


@pytest.mark.parametrize("selection, match", [
    (SharedIndices(jnp.asarray([3, 7, 3])), "appears more than once"),
    (SharedIndices(jnp.asarray([3, 64])), "out of range"),
    (SharedIndices(jnp.asarray([-1, 2])), "out of range"),
    (SharedIndices(jnp.asarray([1, 2]), 3), "count"),
    (PerHeadIndices(jnp.asarray([[0, 1]] * 3 + [[5, 5]])), "appears more than once"),
    (PerHeadIndices(jnp.asarray([[0, 1]] * 3)), r"\[H=4, k\]"),
    (BlockTable(jnp.asarray([0, 4])), "out of range"),
    (BlockTable(jnp.asarray([1, 1]), chunk_tokens=16), "appears more than once"),
    (BlockTable(jnp.asarray([0]), chunk_tokens=24), "multiple of"),
    (BlockTable(jnp.asarray([0]), chunk_tokens=0), "chunk_tokens"),
])
def test_bad_selections_raise_clear_errors(selection, match):
    q, *kv = make_inputs(9, 4, 64)
    with pytest.raises(ValueError, match=match):
        gathered_attention(q, *kv, selection)


def test_bad_shapes_and_blocks_raise():
    q, prefix_k, prefix_v, own_k, own_v = make_inputs(10, 4, 32)
    selection = SharedIndices(jnp.asarray([1, 2]))
    with pytest.raises(ValueError, match="shapes disagree"):
        gathered_attention(q, prefix_k, prefix_v[:, :16], own_k, own_v, selection)
    with pytest.raises(ValueError, match="share"):
        gathered_attention(q[:3], prefix_k, prefix_v, own_k, own_v, selection)
    with pytest.raises(ValueError, match="power of two"):
        gathered_attention(q, prefix_k, prefix_v, own_k, own_v, selection, impl="pallas",
                           block_q=3)
    with pytest.raises(ValueError, match="q_len"):
        gathered_attention(q, prefix_k, prefix_v, own_k, own_v, selection, q_len=5)


def test_reference_matches_float64_oracle_on_larger_shapes():
    q, *kv = make_inputs(11, 128, 4096, heads=8, kv_heads=2, d=64)
    blocks = np.random.default_rng(11).permutation(4096 // 64)[:20]
    out = gathered_attention(q, *kv, BlockTable(jnp.asarray(blocks), 16), q_len=100)  # auto: reference
    tokens = (blocks[:16, None] * 64 + np.arange(64)).reshape(-1)
    expected_out = numpy_attention(q, *kv, [tokens] * 8, 100)
    assert rel_err(out[:, :100], expected_out) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", ["shared", "per_head", "block_table"])
@pytest.mark.parametrize("n_q", [1, 128, 512])
@pytest.mark.parametrize("layout", ["arrays", "pages"])
def test_gpu_compiled_matches_reference(n_q, kind, dtype, layout):
    tokens = 8192
    q, *kv = make_inputs(12, n_q, tokens, heads=32, kv_heads=8, d=128, dtype=dtype)
    if layout == "pages":  # 128 pages of 64 tokens, read in place
        kv[:2] = [as_pages(x, 64) for x in kv[:2]]
    rng = np.random.default_rng(12)
    selection = {
        "shared": SharedIndices(jnp.asarray(rng.permutation(tokens)[:2100]), 2050),
        "per_head": PerHeadIndices(jnp.asarray(
            np.stack([rng.permutation(tokens)[:2100] for _ in range(32)])), 2050),
        "block_table": BlockTable(jnp.asarray(rng.permutation(tokens // 64)[:40]), 33),
    }[kind]
    valid = max(1, n_q - 3)
    expected_out = gathered_attention(q, *kv, selection, impl="reference", q_len=valid)
    out = gathered_attention(q, *kv, selection, impl="pallas", q_len=valid)
    assert rel_err(out[:, :valid], expected_out[:, :valid]) <= TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["shared", "block_table"])
@pytest.mark.parametrize("n_q", [1, 128])
@pytest.mark.parametrize("layout", ["arrays", "pages"])
def test_gpu_compiled_with_qwen_groups_packed_matches_reference(n_q, kind, layout):
    """Qwen2.5-7B's 28 query heads over 4 KV heads: each group of 7 packed in one tile (padded to 8)."""
    tokens = 4096
    q, *kv = make_inputs(16, n_q, tokens, heads=28, kv_heads=4, d=128, dtype=jnp.bfloat16)
    if layout == "pages":
        kv[:2] = [as_pages(x, 64) for x in kv[:2]]
    rng = np.random.default_rng(16)
    selection = {"shared": SharedIndices(jnp.asarray(rng.permutation(tokens)[:1100]), 1030),
                 "block_table": BlockTable(jnp.asarray(rng.permutation(tokens // 64)[:20]), 17)}[kind]
    valid = max(1, n_q - 3)
    expected_out = gathered_attention(q, *kv, selection, impl="reference", q_len=valid)
    out = gathered_attention(q, *kv, selection, impl="pallas", q_len=valid)
    assert rel_err(out[:, :valid], expected_out[:, :valid]) <= TOLERANCE[jnp.bfloat16]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 3), (4, 4)])
def test_attention_over_the_scorings_logits_equals_the_gathered_attention(heads, kv_heads, dtype):
    """Every head's logits from the scoring pass (probe_scores_reference with_logits), a selection's values weighed
    by them: the reference's attention, for shared and per-head sets, over rows as they lie or gathered beforehand
    (spec_gqa's shared set: its rows taken, its columns the scored positions), with padded query rows."""
    from specjax.kernels import attention_over_logits, probe_scores_reference
    n_q, q_len, tokens, prefix_len, capacity, count = 12, 9, 96, 80, 32, 27
    q, prefix_k, prefix_v, own_k, own_v = make_inputs(7, n_q, tokens, heads, kv_heads, dtype=dtype)
    kv_of = tuple(h // (heads // kv_heads) for h in range(heads))
    scores, logits = probe_scores_reference(q, prefix_k, own_k, kv_head_of_probe=kv_of, prefix_len=prefix_len,
                                            q_len=q_len, with_logits=True)
    assert logits.shape == (heads, n_q, tokens + n_q) and logits.dtype == jnp.float32
    np.testing.assert_array_equal(scores, probe_scores_reference(q, prefix_k, own_k, kv_head_of_probe=kv_of,
                                                                 prefix_len=prefix_len, q_len=q_len))
    rng = np.random.default_rng(3)
    shared = SharedIndices(jnp.asarray(rng.permutation(prefix_len)[:capacity], jnp.int32), count)
    per_head = PerHeadIndices(jnp.asarray(np.stack([rng.permutation(prefix_len)[:capacity] for _ in range(heads)]),
                                          jnp.int32), count)
    for selection in (shared, per_head):
        expected = gathered_attention(q, prefix_k, prefix_v, own_k, own_v, selection, q_len=q_len, impl="reference")
        got = attention_over_logits(logits, selection, prefix_v, own_v, selection, q_len=q_len)
        assert got.shape == (heads, n_q, HEAD_DIM) and got.dtype == jnp.float32
        assert rel_err(got.astype(dtype)[:, :q_len], expected[:, :q_len]) <= TOLERANCE[dtype]
        oracle = numpy_attention(q, prefix_k, prefix_v, own_k, own_v,
                                 np.broadcast_to(np.asarray(selection.idx)[..., :count], (heads, count)), q_len)
        assert rel_err(got[:, :q_len], oracle) <= TOLERANCE[dtype]
    # the set's rows taken beforehand (row i holds position shared.idx[i]); the columns still name the positions
    rows = SharedIndices(jnp.arange(capacity, dtype=jnp.int32), count)
    taken_v = jnp.take(prefix_v, shared.idx, axis=1)
    got = attention_over_logits(logits, shared, taken_v, own_v, rows, q_len=q_len)
    expected = gathered_attention(q, prefix_k, prefix_v, own_k, own_v, shared, q_len=q_len, impl="reference")
    assert rel_err(got.astype(dtype)[:, :q_len], expected[:, :q_len]) <= TOLERANCE[dtype]


def test_the_scorings_logits_are_kept_only_where_the_reference_makes_them_and_they_fit(monkeypatch):
    """Pallas never holds a [heads, n_q, m + n_q] array: it gives no logits; the engine's scoring step keeps them
    only up to LOGITS_KEPT_BYTES, and gives the same scores either way."""
    from specjax.engine import steps as S
    from specjax.kernels import probe_scores
    q, prefix_k, _, own_k, _ = make_inputs(1, 16, 64)
    kv_of = (0, 0, 1, 1)
    scores, logits = probe_scores(q, prefix_k, own_k, kv_head_of_probe=kv_of, impl="pallas", with_logits=True)
    assert logits is None and scores.shape == (HEADS, 64)
    np.testing.assert_allclose(scores, probe_scores(q, prefix_k, own_k, kv_head_of_probe=kv_of, impl="reference"),
                               rtol=1e-5, atol=1e-6)
    kept, logits = S.scores(q, prefix_k, own_k, 60, 14, kv_head_of_probe=kv_of, impl="reference", with_logits=True)
    assert logits is not None and logits.shape == (HEADS, 16, 64 + 16)
    np.testing.assert_array_equal(kept, S.scores(q, prefix_k, own_k, 60, 14, kv_head_of_probe=kv_of,
                                                 impl="reference"))
    narrower = prefix_k[:, :48]  # a shape not traced yet, over the limit
    monkeypatch.setattr(S, "LOGITS_KEPT_BYTES", 4 * HEADS * 16 * (48 + 16) - 1)
    scores, none = S.scores(q, narrower, own_k, 40, 14, kv_head_of_probe=kv_of, impl="reference", with_logits=True)
    assert none is None
    np.testing.assert_array_equal(scores, S.scores(q, narrower, own_k, 40, 14, kv_head_of_probe=kv_of,
                                                   impl="reference"))
