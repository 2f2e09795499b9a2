"""The reference probe scoring of every query head (28 over 4 KV heads, Qwen2.5-7B's grouping) at 4,096 prefix
tokens: each query head against its own copy of its KV head's keys (the formulation before this change) against
`probe_scores_reference` now (one product per KV head), and whether the scores are equal bit for bit.

    python benchmarks/results/cpu/selective-takes/drivers/score_bench.py
"""
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.kernels import common as c
from specjax.kernels.probe_scores import probe_scores_reference


@functools.partial(jax.jit, static_argnames=("kv_head_of_probe", "scale"))
def replicated(q, prefix_k, own_k, *, kv_head_of_probe, prefix_len=None, q_len=None, scale=None):
    num_probes, n_q, head_dim = q.shape
    m = prefix_k.shape[1]
    scale = c.default_scale(head_dim, scale)
    prefix_len, q_len = c.length_or_full(prefix_len, m), c.length_or_full(q_len, n_q)
    heads = np.asarray(kv_head_of_probe)
    keys = jnp.concatenate([prefix_k[heads], own_k[heads]], axis=1).astype(jnp.float32)
    scores = jnp.einsum("pqd,pkd->pqk", q.astype(jnp.float32), keys, precision=lax.Precision.HIGHEST) * scale
    rows = jnp.arange(n_q)
    prefix_valid = (jnp.arange(m) < prefix_len)[None, :] & (rows < q_len)[:, None]
    valid = jnp.concatenate([prefix_valid, c.causal_valid(rows, rows, q_len)], axis=1)
    weights = jnp.where(valid, jax.nn.softmax(jnp.where(valid, scores, c.MASK_VALUE), axis=-1), 0.0)
    return weights[:, :, :m].sum(axis=1)


rng = np.random.default_rng(0)
P, G, n, m, d = 28, 4, 64, 4096, 128
q = jnp.asarray(rng.standard_normal((P, n, d)), jnp.bfloat16)
prefix_k = jnp.asarray(rng.standard_normal((G, m, d)), jnp.bfloat16)
own_k = jnp.asarray(rng.standard_normal((G, n, d)), jnp.bfloat16)
heads = tuple(h // (P // G) for h in range(P))
out, times = {}, {"replicated": [], "grouped (now)": []}
calls = {"replicated": replicated, "grouped (now)": probe_scores_reference}
for fn in calls.values():
    for _ in range(2):
        fn(q, prefix_k, own_k, kv_head_of_probe=heads, prefix_len=m, q_len=40).block_until_ready()
for _ in range(15):  # in turns: the machine's drift falls on both alike
    for name, fn in calls.items():
        t = time.perf_counter()
        out[name] = fn(q, prefix_k, own_k, kv_head_of_probe=heads, prefix_len=m, q_len=40).block_until_ready()
        times[name].append((time.perf_counter() - t) * 1e3)
for name, ts in times.items():
    print(f"{name:14s} median {np.median(ts):6.1f} ms  min {min(ts):6.1f} ms  (15 calls in turns, one layer)")
print("equal bit for bit:", bool((out["replicated"] == out["grouped (now)"]).all()))
