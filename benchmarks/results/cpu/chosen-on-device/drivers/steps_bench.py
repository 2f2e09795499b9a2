"""The device steps of one layer at timing-qwen2.5-7b's needle-4k shape (m = 4,135 reused tokens, 39 new ones,
retention 0.25), each alone (median of 20 calls), then 28 layers of as_full and of spec's shared path dispatched
back to back with no host step between (median of 5): the device-bound time of each system's layer chain.

    python benchmarks/results/cpu/chosen-on-device/drivers/steps_bench.py
"""
import time, numpy as np, jax, jax.numpy as jnp
import specjax
from specjax.engine import steps as S, state as st
from specjax.kernels import SharedIndices, PerHeadIndices
from specjax.models import transformer as T
from specjax.shapes import bucket
m = 4135; n = 39
model = specjax.load_model("timing-qwen2.5-7b", init="random", dtype=jnp.bfloat16)
cfg = model.config; lp = model.params["layers"][0]
m_pad, n_pad = bucket(m), bucket(n)
k = int(np.ceil(0.25 * m)); k_cap = bucket(k)
print("m_pad", m_pad, "n_pad", n_pad, "k", k, "k_cap", k_cap, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
rng = np.random.default_rng(0)
dt = jnp.bfloat16
h = jnp.asarray(rng.standard_normal((n_pad, cfg.hidden_size)), dt)
positions = jnp.arange(m, m + n_pad, dtype=jnp.int32)
rot = T.rotary_step(cfg, positions)
K_all = jnp.asarray(rng.standard_normal((cfg.num_kv_heads, m_pad, cfg.head_dim)), dt)
V_all = jnp.asarray(rng.standard_normal((cfg.num_kv_heads, m_pad, cfg.head_dim)), dt)
probe = K_all[:1]
def t(name, fn, reps=20):
    jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        a = time.perf_counter(); jax.block_until_ready(fn()); ts.append(time.perf_counter() - a)
    print(f"{name:40s} {np.median(ts)*1e3:8.2f} ms")
q, own_k, own_v = S.project(cfg, lp, h, positions, rot)
t("project", lambda: S.project(cfg, lp, h, positions, rot))
full_sel = SharedIndices(jnp.arange(m_pad, dtype=jnp.int32), m)
t("finish all rows (as_full)", lambda: S.finish(cfg, lp, h, q, own_k, own_v, K_all, V_all, full_sel, n, impl="auto"))
Kk, Vk = K_all[:, :k_cap], V_all[:, :k_cap]
sh = SharedIndices(jnp.arange(k_cap, dtype=jnp.int32), k)
t("finish shared k rows (spec)", lambda: S.finish(cfg, lp, h, q, own_k, own_v, Kk, Vk, sh, n, impl="auto"))
ph = PerHeadIndices(jnp.asarray(np.stack([rng.permutation(m)[:k_cap] for _ in range(cfg.num_heads)]).astype(np.int32)), k)
t("finish per-head k of m_pad (fallback)", lambda: S.finish(cfg, lp, h, q, own_k, own_v, K_all, V_all, ph, n, impl="auto"))
sc = lambda: S.scores(q, probe, own_k, m, n, kv_head_of_probe=(0, 0, 0), impl="auto", q_heads=(0, 1, 2), kv_heads=(0,))
t("scores probes (3 heads)", sc)
scores = sc()
state = st.ImportanceState.init(cfg.num_layers, m_pad)
t("itf_select", lambda: st.itf_select(state, 3, scores, k, m, 1.0, k_cap=k_cap))
every = lambda: S.scores(q, K_all, own_k, m, n, kv_head_of_probe=tuple(h // 7 for h in range(28)), impl="auto")
t("scores every head (spec_gqa)", every)
E = every()
t("gqa_select", lambda: st.gqa_select(state, 3, E, k, m, 1.0, 0.0, groups=3, probe_rows=21, k_cap=k_cap, guarded=False, kept_of=m))
t("per_head_select", lambda: st.per_head_select(state, 3, E, k, m, k_cap=k_cap))
t("gather_tokens k of m_pad", lambda: S.gather_tokens(K_all, jnp.arange(k_cap, dtype=jnp.int32)))

# 28 layers dispatched back to back, no host step between: the device-bound chain of each system
from specjax.stores.pool import _gather_rows
pages = jnp.zeros((600, 4, 64, 128), jnp.uint16)
table = jnp.asarray(np.stack([np.arange(m_pad) // 64 % 600, np.arange(m_pad) % 64, -np.ones(m_pad), -np.ones(m_pad)]).astype(np.int32))
def chain_full():
    x = h
    for _ in range(cfg.num_layers):
        q, ok, ov = S.project(cfg, lp, x, positions, rot)
        x = S.finish(cfg, lp, x, q, ok, ov, K_all, V_all, full_sel, n, impl="auto")
    return x
def chain_spec():
    x = h
    for layer in range(cfg.num_layers):
        q, ok, ov = S.project(cfg, lp, x, positions, rot)
        s = S.scores(q, probe, ok, m, n, kv_head_of_probe=(0, 0, 0), impl="auto", q_heads=(0, 1, 2), kv_heads=(0,))
        stt, shared, use = st.itf_select(state, layer, s, k, m, 1.0, k_cap=k_cap)
        kk, f1 = _gather_rows(pages, None, table, shared, k, use, dtype=np.dtype(jnp.bfloat16))
        vv, f2 = _gather_rows(pages, None, table, shared, k, f1, dtype=np.dtype(jnp.bfloat16))
        x = S.finish(cfg, lp, x, q, ok, ov, kk, vv, sh, n, impl="auto")
    return x
t("chain as_full (28 layers)", chain_full, reps=5)
t("chain spec shared (28 layers)", chain_spec, reps=5)
