"""`distinct` is np.unique, made by a bitmap where the values are dense enough."""

import numpy as np
import pytest

from specjax import idsets
from specjax.idsets import distinct


CASES = [(0, 10, 0), (1, 1, 5), (4096, 4096, 0), (500, 2000, -700), (64, 64, 30000), (300, 10**7, 0)]


@pytest.mark.parametrize("dtype, n, span, low", [
    (dtype, *case) for dtype in (np.int32, np.int64, np.uint32, np.int16) for case in CASES
    if np.iinfo(dtype).min <= case[2] and case[2] + case[1] <= np.iinfo(dtype).max])
def test_distinct_is_np_unique(dtype, n, span, low):
    ids = (np.random.default_rng(n).integers(0, span, (2, n // 2 + 1))[:, : max(0, n // 2)] + low).astype(dtype)
    want, want_inverse = np.unique(ids, return_inverse=True)
    got = distinct(ids)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    got, inverse = distinct(ids, return_inverse=True)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(inverse, want_inverse.ravel())
    np.testing.assert_array_equal(got[inverse], ids.ravel())


def test_distinct_takes_the_bitmap_only_where_the_values_are_dense(monkeypatch):
    calls = []
    unique = np.unique
    monkeypatch.setattr(idsets.np, "unique", lambda *a, **k: calls.append(1) or unique(*a, **k))
    distinct(np.array([3, 900, 3, 7]))  # within PAGE of each other: a bitmap
    assert not calls
    distinct(np.array([0, 10**9]))  # a span far beyond the count: np.unique
    assert calls
