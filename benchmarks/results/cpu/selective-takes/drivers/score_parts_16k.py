"""At 16k prefix tokens, one layer of 28 query heads over 4 KV heads: the reference scores whole, and their matmul
alone in f32 (as the reference) and in bf16 with f32 accumulation (not the same bits).

    python benchmarks/results/cpu/selective-takes/drivers/score_parts_16k.py
"""
import time, functools, numpy as np, jax, jax.numpy as jnp
from jax import lax
from specjax.kernels import common as c
from specjax.kernels.probe_scores import probe_scores_reference
rng = np.random.default_rng(0)
P, G, n, m, d = 28, 4, 64, 16384, 128
q = jnp.asarray(rng.standard_normal((P, n, d)), jnp.bfloat16)
pk = jnp.asarray(rng.standard_normal((G, m, d)), jnp.bfloat16)
ok = jnp.asarray(rng.standard_normal((G, n, d)), jnp.bfloat16)
heads = tuple(h // 7 for h in range(P))
@jax.jit
def mm32(q, k):
    return jnp.einsum("gqd,gkd->gqk", q.astype(jnp.float32).reshape(G, -1, d), k.astype(jnp.float32), precision=lax.Precision.HIGHEST)
@jax.jit
def mm16(q, k):
    return jnp.einsum("gqd,gkd->gqk", q.reshape(G, -1, d), k, preferred_element_type=jnp.float32)
def t(f):
    f().block_until_ready(); f().block_until_ready(); s=time.perf_counter()
    for _ in range(5): f().block_until_ready()
    return (time.perf_counter()-s)/5*1e3
print("full ref", t(lambda: probe_scores_reference(q, pk, ok, kv_head_of_probe=heads, prefix_len=m, q_len=40)))
print("mm32", t(lambda: mm32(q, pk)))
print("mm16", t(lambda: mm16(q, pk)))
a, b = mm32(q, pk), mm16(q, pk)
print("equal", bool((a == b).all()), float(jnp.abs(a-b).max()))
