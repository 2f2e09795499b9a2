import time, functools, jax, jax.numpy as jnp, numpy as np
from specjax.engine import state as st
from specjax.models.inference import bucket
from specjax.kernels import itf
m=1063; m_pad=bucket(m); k=266; k_cap=bucket(k); H=9
s0=st.ImportanceState.init(30, m_pad)
scores=jnp.asarray(np.random.default_rng(0).random((H,m_pad),np.float32))
def bench(f, n=300):
    for _ in range(5): out=f()
    jax.block_until_ready(out); ts=[]
    for r in range(7):
        t=time.perf_counter()
        for _ in range(n): out=f()
        jax.block_until_ready(out); ts.append((time.perf_counter()-t)/n*1e6)
    return np.median(ts)
@functools.partial(jax.jit, static_argnames=("k_cap",))
def tk(x, prefix_len, *, k_cap): return itf.top_k(x, k_cap, prefix_len)
@functools.partial(jax.jit, static_argnames=("k_cap",))
def ident(head_scores, k, prefix_len, alpha, *, k_cap):
    probes = st.kv_head_scores(head_scores, prefix_len, groups=3)
    return probes, itf.identify(probes, k, prefix_len, alpha, k_cap=k_cap)
@functools.partial(jax.jit, static_argnames=("k_cap",))
def both(head_scores, k, prefix_len, alpha, *, k_cap):
    probes = st.kv_head_scores(head_scores, prefix_len, groups=3)
    return itf.top_k(head_scores, k_cap, prefix_len), probes, itf.identify(probes, k, prefix_len, alpha, k_cap=k_cap)
@functools.partial(jax.jit, static_argnames=("k_cap",))
def both_barrier(head_scores, k, prefix_len, alpha, *, k_cap):
    per_head = itf.top_k(head_scores, k_cap, prefix_len)
    head_scores, per_head = jax.lax.optimization_barrier((head_scores, per_head))
    probes = st.kv_head_scores(head_scores, prefix_len, groups=3)
    return per_head, probes, itf.identify(probes, k, prefix_len, alpha, k_cap=k_cap)
for name, f in [("per_head_select", lambda: st.per_head_select(s0, 3, scores, k, m, k_cap=k_cap, kept_of=m)),
                ("gqa_select", lambda: st.gqa_select(s0, 3, scores, k, m, 0.6, 0.9, groups=3, probe_rows=9, k_cap=k_cap, guarded=True, kept_of=m)),
                ("top_k 9", lambda: tk(scores, m, k_cap=k_cap)),
                ("ident", lambda: ident(scores, k, m, 0.6, k_cap=k_cap)),
                ("top_k 9 then ident (2 calls)", lambda: (tk(scores, m, k_cap=k_cap), ident(scores, k, m, 0.6, k_cap=k_cap))),
                ("both in one jit", lambda: both(scores, k, m, 0.6, k_cap=k_cap)),
                ("both, barrier", lambda: both_barrier(scores, k, m, 0.6, k_cap=k_cap))]:
    print(f"{name:32s} {bench(f):7.0f} us")
