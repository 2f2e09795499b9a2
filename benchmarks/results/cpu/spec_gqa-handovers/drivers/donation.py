"""gqa_select with and without donating its state (its buffers then updated in place), 300 calls each, interleaved."""
import time, functools, jax, jax.numpy as jnp, numpy as np
from specjax.engine import state as st
H, m_pad, m, k, k_cap = 9, 1280, 1100, 275, 320
rng = np.random.default_rng(0)
scores = jnp.asarray(rng.random((H, m_pad)).astype(np.float32))
plain = jax.jit(st.gqa_select.__wrapped__, static_argnames=("groups", "probe_rows", "k_cap", "guarded"))
donated = jax.jit(st.gqa_select.__wrapped__, static_argnames=("groups", "probe_rows", "k_cap", "guarded"), donate_argnums=(0,))
kw = dict(groups=3, probe_rows=9, k_cap=k_cap, guarded=True, kept_of=m)
s1 = st.ImportanceState.init(30, m_pad); s2 = jax.tree.map(jnp.copy, st.ImportanceState.init(30, m_pad))
out1 = plain(s1, 3, scores, k, m, 0.6, 0.9, **kw); out2 = donated(s2, 3, scores, k, m, 0.6, 0.9, **kw)
s1, s2 = out1[0], out2[0]
jax.block_until_ready((s1, s2))
res = {"plain": [], "donated": []}
for rep in range(300):
    t = time.perf_counter(); o = plain(s1, 3 + rep % 20, scores, k, m, 0.6, 0.9, **kw); jax.block_until_ready(o); res["plain"].append(time.perf_counter() - t); s1 = o[0]
    t = time.perf_counter(); o = donated(s2, 3 + rep % 20, scores, k, m, 0.6, 0.9, **kw); jax.block_until_ready(o); res["donated"].append(time.perf_counter() - t); s2 = o[0]
for n, v in res.items():
    v = np.sort(v); print(n, "min %.3f median %.3f ms" % (v[0]*1e3, v[len(v)//2]*1e3))
print(jax.tree.map(lambda a, b: bool((a == b).all()) if a.dtype != jnp.float32 else bool(jnp.allclose(a, b, equal_nan=True)), s1, s2))
