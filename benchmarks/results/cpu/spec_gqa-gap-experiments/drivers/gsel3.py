import time, functools, jax, jax.numpy as jnp, numpy as np
from specjax.kernels import itf
from specjax.engine import state as st
H, m_pad, k, m = 9, 1152, 268, 1070
k_cap = 288
s = st.ImportanceState.init(30, 1152)
rng = np.random.default_rng(0)
scores = jnp.asarray(rng.random((H, m_pad)).astype(np.float32))
def t(name, f, n=500):
    jax.block_until_ready(f()); best = 1e9
    for rep in range(3):
        t0 = time.perf_counter()
        for _ in range(n): out = f()
        jax.block_until_ready(out); best = min(best, (time.perf_counter() - t0) / n * 1e3)
    print(f"{name:30s} {best:.3f} ms"); return out
g = lambda: st.gqa_select(s, 3, scores, k, m, 0.6, 0.9, groups=3, probe_rows=9, k_cap=k_cap, guarded=True, kept_of=m)
t("gqa_select", g)
t("per_head_select", lambda: st.per_head_select(s, 3, scores, k, m, k_cap=k_cap, kept_of=m))
lowered = jax.jit(st.gqa_select.__wrapped__ if hasattr(st.gqa_select, "__wrapped__") else None, static_argnames=("groups", "probe_rows", "k_cap", "guarded"))
probes = st.kv_head_scores(scores, m, groups=3)
t("identify", lambda: itf.identify(probes, k, m, 0.6, k_cap=k_cap))
@functools.partial(jax.jit, static_argnames=("k_cap",))
def identify2(probe_scores, k, prefix_len, alpha, *, k_cap):
    per_probe = itf.top_k(probe_scores, k_cap, prefix_len)
    jaccard = itf.mean_pairwise_jaccard(per_probe, count=k)
    threshold = itf.itf_threshold(k, prefix_len, alpha)
    shared = itf.top_k(itf.normalised(probe_scores, prefix_len).sum(0, keepdims=True), k_cap, prefix_len)[0]
    return shared, per_probe, jaccard, threshold, jaccard >= threshold
t("identify 2-D shared", lambda: identify2(probes, k, m, 0.6, k_cap=k_cap))
a = itf.identify(probes, k, m, 0.6, k_cap=k_cap); b = identify2(probes, k, m, 0.6, k_cap=k_cap)
print((a.shared == b[0]).all())
@functools.partial(jax.jit, static_argnames=("k_cap",))
def pieces(probe_scores, k, prefix_len, alpha, *, k_cap):
    per_probe = itf.top_k(probe_scores, k_cap, prefix_len)
    return per_probe
t("identify: per_probe only", lambda: pieces(probes, k, m, 0.6, k_cap=k_cap))
@functools.partial(jax.jit, static_argnames=("k_cap",))
def pieces2(probe_scores, k, prefix_len, alpha, *, k_cap):
    return itf.top_k(itf.normalised(probe_scores, prefix_len).sum(0), k_cap, prefix_len)
t("identify: shared only (1-D)", lambda: pieces2(probes, k, m, 0.6, k_cap=k_cap))
pp = pieces(probes, k, m, 0.6, k_cap=k_cap)
t("jaccard", lambda: itf.mean_pairwise_jaccard(pp, count=k))
@functools.partial(jax.jit, static_argnames=("k_cap",))
def two(scores, probes, k, prefix_len, *, k_cap):
    return itf.top_k(scores, k_cap, prefix_len), itf.identify(probes, k, prefix_len, 0.6, k_cap=k_cap)
t("per_head topk + identify one jit", lambda: two(scores, probes, k, m, k_cap=k_cap))
@functools.partial(jax.jit, static_argnames=("k_cap",))
def two2(scores, k, prefix_len, *, k_cap):
    probes = st.kv_head_scores(scores, prefix_len, groups=3)
    return itf.top_k(scores, k_cap, prefix_len), itf.identify(probes, k, prefix_len, 0.6, k_cap=k_cap)
t("+kv_head_scores inside", lambda: two2(scores, k, m, k_cap=k_cap))
@functools.partial(jax.jit, static_argnames=("k_cap",))
def cat(scores, k, prefix_len, *, k_cap):
    probes = st.kv_head_scores(scores, prefix_len, groups=3)
    rows = jnp.concatenate([scores, probes, itf.normalised(probes, prefix_len).sum(0, keepdims=True)])
    return itf.top_k(rows, k_cap, prefix_len)
t("one topk over 13 rows", lambda: cat(scores, k, m, k_cap=k_cap))
print(jax.jit(lambda x: itf.top_k(x, k_cap, m)).lower(scores).compile().as_text()[:3000])
print("----")
t("per_head topk + identify one jit", lambda: two(scores, probes, k, m, k_cap=k_cap))
t("+kv_head_scores inside", lambda: two2(scores, k, m, k_cap=k_cap))
topk9 = jax.jit(lambda x: itf.top_k(x, k_cap, m))
@jax.jit
def rest(state, scores, per_head):
    probes = st.kv_head_scores(scores, m, groups=3)
    d = itf.identify(probes, k, m, 0.6, k_cap=k_cap)
    state = st._record_itf(state, 3, d, k, m, m)
    state, use = st._guard(state, 3, scores, d.shared, k, m, d.use_shared, 0.9, k_cap, per_head)
    return state, probes, d.shared, use
def split():
    ph = topk9(scores)
    return rest(s, scores, ph), ph
t("split in two jits", split)
