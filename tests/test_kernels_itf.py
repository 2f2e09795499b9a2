"""SPEC's ITF helpers: top-k sets, mean pairwise Jaccard, the threshold, the shared set."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels import identify, itf_threshold, mean_pairwise_jaccard
from specjax.kernels.itf import mean_pairwise_jaccard_of_masks, set_columns, top_k, top_k_mask


def test_jaccard_paper_example():
    # SPEC Fig. 7(a): h0 = {0, 2}, h1 = {0, 1} -> 1/3.
    assert float(mean_pairwise_jaccard(jnp.asarray([[0, 2], [0, 1]]))) == pytest.approx(1 / 3)


def test_jaccard_matches_python_sets_and_ignores_order():
    rng = np.random.default_rng(0)
    idx = np.stack([rng.permutation(50)[:20] for _ in range(4)])
    sets = [set(row) for row in idx]
    expected = np.mean([len(a & b) / len(a | b) for a, b in itertools.combinations(sets, 2)])
    assert float(mean_pairwise_jaccard(jnp.asarray(idx))) == pytest.approx(expected, rel=1e-6)


def test_jaccard_count_and_degenerate_cases():
    idx = jnp.asarray([[0, 2, 5], [0, 1, 5], [7, 8, 5]])
    # Only the first 2 entries of each row count: {0,2},{0,1},{7,8} -> (1/3 + 0 + 0) / 3.
    assert float(mean_pairwise_jaccard(idx, count=2)) == pytest.approx(1 / 9)
    assert float(mean_pairwise_jaccard(idx, count=0)) == 1.0
    assert float(mean_pairwise_jaccard(idx[:1])) == 1.0
    assert float(mean_pairwise_jaccard(jnp.asarray([[3, 4], [4, 3]]))) == 1.0


def test_threshold_formula():
    k, n = 25, 100
    j = (k * k / n) / (2 * k - k * k / n)
    assert float(itf_threshold(k, n)) == pytest.approx(j ** 0.6, rel=1e-6)
    assert float(itf_threshold(k, n, alpha=1.0)) == pytest.approx(j, rel=1e-6)
    assert float(itf_threshold(n, n)) == pytest.approx(1.0)  # keeping everything
    assert float(itf_threshold(0, n)) == 0.0
    # Traced inside jit, as the engine calls it.
    assert float(jax.jit(itf_threshold)(jnp.int32(k), jnp.int32(n))) == pytest.approx(j ** 0.6)


def test_top_k_is_best_first_and_skips_padding():
    scores = jnp.asarray([[1.0, 5.0, 3.0, 0.0, 9.0], [2.0, 1.0, 9.0, 1.0, 8.0]])
    np.testing.assert_array_equal(top_k(scores, 2), [[4, 1], [2, 4]])
    np.testing.assert_array_equal(top_k(scores, 2, prefix_len=3), [[1, 2], [2, 0]])
    assert top_k(scores, 2).dtype == jnp.int32
    # Past the prefix, padding columns come only after every valid one.
    assert set(np.asarray(top_k(scores, 4, prefix_len=3))[0, :3].tolist()) == {0, 1, 2}


@pytest.mark.parametrize("prefix_len", [None, 700, 1])
def test_top_k_mask_is_the_set_top_k_gives_first(prefix_len):
    """The mask keeps exactly the columns `top_k` lists first, ties (many here: scores in steps of 1/8, zeros, an
    infinity) broken as it breaks them, for k from none to past the valid columns; traced k; a row's set as its
    ascending columns."""
    rng = np.random.default_rng(0)
    scores = np.round(rng.random((5, 1000)) * 8) / 8
    scores[1] = 0.0
    scores[2, 3] = np.inf
    scores[3, ::7] = 1e-30
    scores = jnp.asarray(scores, jnp.float32)
    mask_of = jax.jit(lambda s, k: top_k_mask(s, k, prefix_len))
    for k in (0, 1, 2, 37, 250, 700, 1000):
        mask = np.asarray(mask_of(scores, k))
        want = np.zeros(mask.shape, bool)
        if k:
            np.put_along_axis(want, np.asarray(top_k(scores, k, prefix_len)), True, axis=-1)
        np.testing.assert_array_equal(mask, want, err_msg=f"k={k}")
        cols = np.asarray(set_columns(jnp.asarray(mask), 1024))
        for row, got in zip(mask, cols):
            listed = np.flatnonzero(row)
            np.testing.assert_array_equal(got[: len(listed)], listed)
            assert not got[len(listed):].any()


def test_jaccard_of_masks_equals_jaccard_of_index_sets():
    rng = np.random.default_rng(1)
    idx = np.stack([rng.choice(50, 12, replace=False) for _ in range(4)]).astype(np.int32)
    masks = np.zeros((4, 50), bool)
    np.put_along_axis(masks, idx, True, axis=-1)
    assert float(mean_pairwise_jaccard_of_masks(jnp.asarray(masks))) == float(mean_pairwise_jaccard(jnp.asarray(idx)))
    assert float(mean_pairwise_jaccard_of_masks(jnp.asarray(masks[:1]))) == 1.0
    assert float(mean_pairwise_jaccard_of_masks(jnp.zeros((3, 50), bool))) == 1.0  # empty sets: nothing disagrees


def test_shared_set_normalises_each_head():
    # Head 1's scores are ~1000x larger; after dividing by their sum both heads weigh the
    # same: [0.2, 0.7, 0.1, 0] + [0.1, 0, 0.3, 0.6] -> {1, 3} (raw sums would give {2, 3}).
    scores = jnp.asarray([[0.2, 0.7, 0.1, 0.0], [100.0, 0.0, 300.0, 600.0]])
    np.testing.assert_array_equal(identify(scores, 2, 4, 0.6, k_cap=2).shared, [1, 3])
    np.testing.assert_array_equal(identify(scores, 1, 2, 0.6, k_cap=1).shared, [0])


def test_identify_decides_with_the_threshold():
    # Two probes agreeing on {0, 1} of 8 tokens (Jaccard 1) share; disjoint sets (Jaccard 0) do not.
    agree = jnp.asarray([[5.0, 4.0, 0, 0, 0, 0, 0, 0], [4.0, 5.0, 0, 0, 0, 0, 0, 0]])
    decision = identify(agree, 2, 8, 0.6, k_cap=2)
    assert bool(decision.use_shared) and float(decision.jaccard) == 1.0
    assert float(decision.threshold) == pytest.approx(float(itf_threshold(2, 8, 0.6)))
    np.testing.assert_array_equal(decision.probe_sets, [[1, 1, 0, 0, 0, 0, 0, 0]] * 2)
    apart = jnp.asarray([[5.0, 4.0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 4.0, 5.0]])
    decision = identify(apart, 2, 8, 0.6, k_cap=2)
    assert not bool(decision.use_shared) and float(decision.jaccard) == 0.0
