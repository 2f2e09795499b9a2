import time, functools, jax, jax.numpy as jnp, numpy as np
from specjax.kernels import itf
from specjax.engine import state as st
H, m_pad, k, m = 9, 1152, 268, 1070
k_cap = 288
s = st.ImportanceState.init(30, 1152)
rng = np.random.default_rng(0)
scores = jnp.asarray(rng.random((H, m_pad)).astype(np.float32))
def t(name, f, n=400):
    jax.block_until_ready(f()); best = 1e9
    for rep in range(5):
        t0 = time.perf_counter()
        for _ in range(n): out = f()
        jax.block_until_ready(out); best = min(best, (time.perf_counter() - t0) / n * 1e3)
    print(f"{name:40s} {best:.3f} ms"); return out
t("gqa_select guarded", lambda: st.gqa_select(s, 3, scores, k, m, 0.6, 0.9, groups=3, probe_rows=9, k_cap=k_cap, guarded=True, kept_of=m))
t("gqa_select unguarded", lambda: st.gqa_select(s, 3, scores, k, m, 0.6, 0.9, groups=3, probe_rows=9, k_cap=k_cap, guarded=False, kept_of=m))
t("per_head_select", lambda: st.per_head_select(s, 3, scores, k, m, k_cap=k_cap, kept_of=m))
@functools.partial(jax.jit, static_argnames=("k_cap",))
def nostate(head_scores, k, prefix_len, alpha, min_share, *, k_cap):
    probes = st.kv_head_scores(head_scores, prefix_len, groups=3)
    per_head = itf.top_k(head_scores, k_cap, prefix_len)
    d = itf.identify(probes, k, prefix_len, alpha, k_cap=k_cap)
    share = itf.head_share(head_scores, d.shared, k, prefix_len, k_cap=k_cap, own_top=per_head)
    return probes, d.shared, per_head, d.use_shared & (share >= min_share), d.jaccard, d.threshold, share
t("no state", lambda: nostate(scores, k, m, 0.6, 0.9, k_cap=k_cap))
@functools.partial(jax.jit, static_argnames=("k_cap",))
def topk_only(head_scores, prefix_len, *, k_cap):
    return itf.top_k(head_scores, k_cap, prefix_len)
t("top_k 9 rows", lambda: topk_only(scores, m, k_cap=k_cap))
@functools.partial(jax.jit, static_argnames=("k_cap",))
def topk_sort(head_scores, prefix_len, *, k_cap):
    valid = jnp.arange(head_scores.shape[-1]) < prefix_len
    return jnp.argsort(-jnp.where(valid, head_scores, -jnp.inf), axis=-1)[:, :k_cap].astype(jnp.int32)
t("argsort 9 rows", lambda: topk_sort(scores, m, k_cap=k_cap))
@functools.partial(jax.jit, static_argnames=("k_cap",))
def topk_13(head_scores, prefix_len, *, k_cap):
    return itf.top_k(jnp.concatenate([head_scores, head_scores[:4]]), k_cap, prefix_len)
t("top_k 13 rows", lambda: topk_13(scores, m, k_cap=k_cap))
@jax.jit
def noop(x): return x + 1
t("noop dispatch", lambda: noop(scores))
