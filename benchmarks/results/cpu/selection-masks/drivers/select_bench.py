"""One layer's selection steps at Qwen2.5-7B's 28 query heads, a quarter kept: lax.top_k (a sort; the per-head sets
before) against kernels.itf.top_k_mask (the sets as masks, from the k-th score) and with the sets listed
(set_columns), on random scores; checks they are the same sets. Mean of 10 after a warm-up, ms.

    python benchmarks/results/cpu/selection-masks/drivers/select_bench.py
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.kernels import itf


def ms(fn, *args, n=10):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(n):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / n * 1e3


rng = np.random.default_rng(0)
for m in (4160, 16512):
    k = m // 4
    scores = jnp.asarray(rng.random((28, m)), jnp.float32)
    sort = jax.jit(lambda s: lax.top_k(s, k)[1])
    mask = jax.jit(lambda s: itf.top_k_mask(s, k))
    listed = jax.jit(lambda s: itf.set_columns(itf.top_k_mask(s, k), k))
    same = (np.sort(np.asarray(sort(scores)), -1) == np.asarray(listed(scores))).all()
    print(f"m={m} k={k}: lax.top_k {ms(sort, scores):.1f}  top_k_mask {ms(mask, scores):.1f}  "
          f"+ set_columns {ms(listed, scores):.1f}  same sets {bool(same)}")
