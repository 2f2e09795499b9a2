"""spec_gqa's decision step and its parts at smollm2's shapes (9 query heads over 3 KV heads, 1,280 padded positions,
k_cap 320), against as_h2o_lfu's per-head selection; each variant timed 300 times, interleaved, min and median."""
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.engine import state as st
from specjax.kernels import itf

H, m_pad, m, k, k_cap = 9, 1280, 1100, 275, 320
rng = np.random.default_rng(0)
scores = jnp.asarray(rng.random((H, m_pad)).astype(np.float32))
state = st.ImportanceState.init(30, m_pad)
probe_idx = itf.top_k(scores[:3], k_cap, m)


@jax.jit
def no_state(scores):
    probes = st.kv_head_scores(scores, m, groups=3)
    per_head = itf.top_k(scores, k_cap, m)
    d = itf.identify(probes, k, m, 0.6, k_cap=k_cap)
    share = itf.head_share(scores, d.shared, k, m, k_cap=k_cap, own_top=per_head)
    return per_head, d.shared, d.use_shared & (share >= 0.9)


@jax.jit
def no_guard(scores):
    probes = st.kv_head_scores(scores, m, groups=3)
    per_head = itf.top_k(scores, k_cap, m)
    d = itf.identify(probes, k, m, 0.6, k_cap=k_cap)
    return per_head, d.shared, d.use_shared


@jax.jit
def itf_test_alone(scores):
    d = itf.identify(st.kv_head_scores(scores, m, groups=3), k, m, 0.6, k_cap=k_cap)
    return d.shared, d.use_shared


@jax.jit
def three_top_k(scores):
    probes = scores[:3] + 1
    return lax.top_k(scores, k_cap)[1], lax.top_k(probes, k_cap)[1], lax.top_k(probes[:1], k_cap)[1]


@jax.jit
def one_top_k(scores):
    probes = scores[:3] + 1
    return lax.top_k(jnp.concatenate([scores, probes, probes[:1]]), k_cap)[1]


@jax.jit
def mask_jaccard(idx):
    num, kk = idx.shape
    valid = jnp.arange(kk)[None, :] < k
    rows = jnp.broadcast_to(jnp.arange(num)[:, None], idx.shape)
    masks = jnp.zeros((num, m_pad + 1), jnp.float32).at[rows, jnp.where(valid, idx, m_pad)].set(1.0)[:, :m_pad]
    first, second = (np.asarray(side) for side in zip(*itertools.combinations(range(num), 2)))
    inter = (masks[first] * masks[second]).sum(1)
    union = 2 * k - inter
    return jnp.where(union > 0, inter / jnp.maximum(union, 1), 1.0).mean()


top_k_rows = jax.jit(lambda s: lax.top_k(s, k_cap)[1])
argsort_rows = jax.jit(lambda s: jnp.argsort(-s, axis=-1)[:, :k_cap])
sort_key_val_rows = jax.jit(lambda s: lax.sort_key_val(-s, jnp.broadcast_to(jnp.arange(m_pad), s.shape),
                                                       dimension=-1)[1][:, :k_cap])
approx_rows = jax.jit(lambda s: lax.approx_max_k(s, k_cap, recall_target=1.0)[1])

variants = {
    "gqa_select (spec_gqa)": lambda: st.gqa_select(state, 3, scores, k, m, 0.6, 0.9, groups=3, probe_rows=9,
                                                   k_cap=k_cap, guarded=True, kept_of=m),
    "per_head_select (as_h2o_lfu)": lambda: st.per_head_select(state, 3, scores, k, m, k_cap=k_cap, kept_of=m),
    "gqa without the state's updates": lambda: no_state(scores),
    "gqa without the guard or state": lambda: no_guard(scores),
    "ITF's test alone": lambda: itf_test_alone(scores),
    # the scores are arguments, not constants: XLA would fold a sort of constants while compiling
    "lax.top_k of 9 rows": lambda: top_k_rows(scores),
    "argsort of 9 rows": lambda: argsort_rows(scores),
    "sort_key_val of 9 rows": lambda: sort_key_val_rows(scores),
    "approx_max_k of 9 rows": lambda: approx_rows(scores),
    "three top_k calls (9, 3, 1 rows)": lambda: three_top_k(scores),
    "one top_k of the 13 rows": lambda: one_top_k(scores),
    "Jaccard by sorting merged pairs": lambda: itf.mean_pairwise_jaccard(probe_idx, count=k),
    "Jaccard by set masks": lambda: mask_jaccard(probe_idx),
}
assert float(itf.mean_pairwise_jaccard(probe_idx, count=k)) == float(mask_jaccard(probe_idx))
for f in variants.values():
    jax.block_until_ready(f())
times = {name: [] for name in variants}
for _ in range(300):
    for name, f in variants.items():
        t = time.perf_counter()
        jax.block_until_ready(f())
        times[name].append(time.perf_counter() - t)
print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
for name, ts in times.items():
    ts = np.sort(ts)
    print(f"{name:36s} min {ts[0] * 1e3:.3f} ms, median {ts[len(ts) // 2] * 1e3:.3f} ms")
