"""SPEC's ITF helpers: top-k sets, mean pairwise Jaccard, the threshold, the shared set."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels import (
    itf_threshold,
    mean_pairwise_jaccard,
    shared_topk,
    topk_per_head,
    use_shared_selection,
)


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
    assert bool(use_shared_selection(0.5, k, n)) and not bool(use_shared_selection(0.2, k, n))
    # Traced inside jit, as the engine calls it.
    assert float(jax.jit(itf_threshold)(jnp.int32(k), jnp.int32(n))) == pytest.approx(j ** 0.6)


def test_topk_per_head_is_sorted_and_skips_padding():
    scores = jnp.asarray([[1.0, 5.0, 3.0, 0.0, 9.0], [2.0, 1.0, 9.0, 1.0, 8.0]])
    np.testing.assert_array_equal(topk_per_head(scores, 2), [[1, 4], [2, 4]])
    np.testing.assert_array_equal(topk_per_head(scores, 2, prefix_len=3), [[1, 2], [0, 2]])
    assert topk_per_head(scores, 2).dtype == jnp.int32
    with pytest.raises(ValueError, match="k=6"):
        topk_per_head(scores, 6)


def test_shared_topk_normalises_each_head():
    # Head 1's scores are ~1000x larger; after dividing by their sum both heads weigh the
    # same: [0.2, 0.7, 0.1, 0] + [0.1, 0, 0.3, 0.6] -> {1, 3} (raw sums would give {2, 3}).
    scores = jnp.asarray([[0.2, 0.7, 0.1, 0.0], [100.0, 0.0, 300.0, 600.0]])
    np.testing.assert_array_equal(shared_topk(scores, 2), [1, 3])
    np.testing.assert_array_equal(shared_topk(scores, 1, prefix_len=2), [0])
