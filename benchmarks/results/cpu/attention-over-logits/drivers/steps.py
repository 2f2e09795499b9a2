"""Device steps at timing-qwen2.5-7b's needle-4k shape (m = 4,135 reused tokens, 39 new, retention 0.25): each step
alone (median of 20 calls), then 28-layer chains dispatched back to back with no host step between, taken in turn
(round robin, median of 7 rounds): as_full's; a per-head layer's (every head scored, each head's top-k, the
attention over its own rows) with the attention computing its key products again (before) or weighing the values
by the scoring's logits (after); spec's and spec_gqa's, with as many layers falling back as in the 4k line-up: the
device-bound time of each system's request at this shape. Checks that both attentions give the same hidden states
bit for bit.

    python benchmarks/results/cpu/attention-over-logits/drivers/steps.py
"""
import time
import numpy as np, jax, jax.numpy as jnp
import specjax
from specjax.engine import steps as S, state as st
from specjax.kernels import SharedIndices, PerHeadIndices
from specjax.models import transformer as T
from specjax.shapes import bucket

m, n = 4135, 39
model = specjax.load_model("timing-qwen2.5-7b", init="random", dtype=jnp.bfloat16)
cfg = model.config; lp = model.params["layers"][0]
m_pad, n_pad = bucket(m), bucket(n)
k = int(np.ceil(0.25 * m)); k_cap = bucket(k)
print("m_pad", m_pad, "n_pad", n_pad, "k", k, "k_cap", k_cap, "heads", cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
rng = np.random.default_rng(0)
h = jnp.asarray(rng.standard_normal((n_pad, cfg.hidden_size)), jnp.bfloat16)
positions = jnp.arange(m, m + n_pad, dtype=jnp.int32)
rot = T.rotary_step(cfg, positions)
K_all = jnp.asarray(rng.standard_normal((cfg.num_kv_heads, m_pad, cfg.head_dim)), jnp.bfloat16)
V_all = jnp.asarray(rng.standard_normal((cfg.num_kv_heads, m_pad, cfg.head_dim)), jnp.bfloat16)
kv_of = tuple(head // cfg.q_per_kv for head in range(cfg.num_heads))
state = st.ImportanceState.init(cfg.num_layers, m_pad)
full = SharedIndices(jnp.arange(m_pad, dtype=jnp.int32), m)


def timed(fn, reps):
    jax.block_until_ready(fn())
    out = []
    for _ in range(reps):
        a = time.perf_counter(); jax.block_until_ready(fn()); out.append(time.perf_counter() - a)
    return out


q, own_k, own_v = S.project(cfg, lp, h, positions, rot)
E, L = S.scores(q, K_all, own_k, m, n, kv_head_of_probe=kv_of, impl="auto", with_logits=True)
_, per_head = st.per_head_select(state, 3, E, k, m, k_cap=k_cap)
ph = PerHeadIndices(per_head, k)
steps = {
    "finish all rows (as_full)": lambda: S.finish(cfg, lp, h, q, own_k, own_v, K_all, V_all, full, n, impl="auto"),
    "scores every head": lambda: S.scores(q, K_all, own_k, m, n, kv_head_of_probe=kv_of, impl="auto"),
    "scores every head, logits kept": lambda: S.scores(q, K_all, own_k, m, n, kv_head_of_probe=kv_of, impl="auto",
                                                       with_logits=True),
    "per_head_select": lambda: st.per_head_select(state, 3, E, k, m, k_cap=k_cap),
    "finish per-head sets": lambda: S.finish(cfg, lp, h, q, own_k, own_v, K_all, V_all, ph, n, impl="auto"),
    "finish per-head sets over the logits": lambda: S.finish(cfg, lp, h, q, own_k, own_v, K_all, V_all, ph, n,
                                                             impl="auto", logits=S.ScoredLogits(L, ph)),
}
for name, fn in steps.items():
    print(f"{name:40s} {np.median(timed(fn, 20)) * 1e3:8.2f} ms", flush=True)
a = S.finish(cfg, lp, h, q, own_k, own_v, K_all, V_all, ph, n, impl="auto")
b = S.finish(cfg, lp, h, q, own_k, own_v, K_all, V_all, ph, n, impl="auto", logits=S.ScoredLogits(L, ph))
print("hidden states equal bit for bit:", bool((np.asarray(a[:n]) == np.asarray(b[:n])).all()))


def chain_full():
    x = h
    for _ in range(cfg.num_layers):
        q, ok, ov = S.project(cfg, lp, x, positions, rot)
        x = S.finish(cfg, lp, x, q, ok, ov, K_all, V_all, full, n, impl="auto")
    return x


def chain_per_head(over_logits):
    def chain():
        x = h
        for layer in range(cfg.num_layers):
            q, ok, ov = S.project(cfg, lp, x, positions, rot)
            scores, logits = S.scores(q, K_all, ok, m, n, kv_head_of_probe=kv_of, impl="auto", with_logits=True) \
                if over_logits else (S.scores(q, K_all, ok, m, n, kv_head_of_probe=kv_of, impl="auto"), None)
            _, idx = st.per_head_select(state, layer, scores, k, m, k_cap=k_cap)
            sel = PerHeadIndices(idx, k)
            x = S.finish(cfg, lp, x, q, ok, ov, K_all, V_all, sel, n, impl="auto",
                         logits=None if logits is None else S.ScoredLogits(logits, sel))
        return x
    return chain


probe_q, probe_kv = (0, 1, 2), (0,)  # SPEC's probe heads at this shape: query heads 0-2, all of KV head 0


def shared_tail(x, q, ok, ov, shared):
    """A shared set's rows gathered on the device (as TakeChosen does) and attended to."""
    keys, values = S.gather_tokens(K_all, shared), S.gather_tokens(V_all, shared)
    return S.finish(cfg, lp, x, q, ok, ov, keys, values, SharedIndices(jnp.arange(k_cap, dtype=jnp.int32), k), n,
                    impl="auto")


def per_head_tail(x, q, ok, ov, layer, over_logits=True):
    scores, logits = S.scores(q, K_all, ok, m, n, kv_head_of_probe=kv_of, impl="auto", with_logits=True)
    _, idx = st.per_head_select(state, layer, scores, k, m, k_cap=k_cap)
    sel = PerHeadIndices(idx, k)
    return S.finish(cfg, lp, x, q, ok, ov, K_all, V_all, sel, n, impl="auto", logits=S.ScoredLogits(logits, sel))


def chain_spec(fallbacks):
    """ITF: the probe heads score and decide; `fallbacks` of the 28 layers then score every head (per-head H2O),
    the others take the shared set (the line-up's spec fell back on 4-5 layers a request)."""
    def chain():
        x = h
        for layer in range(cfg.num_layers):
            q, ok, ov = S.project(cfg, lp, x, positions, rot)
            probe = S.scores(q, K_all[:1], ok, m, n, kv_head_of_probe=(0, 0, 0), impl="auto", q_heads=probe_q,
                             kv_heads=probe_kv)
            _, shared, _ = st.itf_select(state, layer, probe, k, m, 1.0, k_cap=k_cap)
            x = per_head_tail(x, q, ok, ov, layer) if layer < fallbacks else shared_tail(x, q, ok, ov, shared)
        return x
    return chain


def chain_spec_gqa(fallbacks):
    """spec_gqa (guarded): every head scored, the whole decision in one step; `fallbacks` of the 28 layers keep
    per-head sets (15-16 in the line-up), the others the shared set."""
    def chain():
        x = h
        for layer in range(cfg.num_layers):
            q, ok, ov = S.project(cfg, lp, x, positions, rot)
            scores, logits = S.scores(q, K_all, ok, m, n, kv_head_of_probe=kv_of, impl="auto", with_logits=True)
            _, _, shared, per_head, _ = st.gqa_select(state, layer, scores, k, m, 1.0, 0.9, groups=3, probe_rows=21,
                                                      k_cap=k_cap, guarded=True, kept_of=m)
            if layer < fallbacks:
                sel = PerHeadIndices(per_head, k)
                x = S.finish(cfg, lp, x, q, ok, ov, K_all, V_all, sel, n, impl="auto",
                             logits=S.ScoredLogits(logits, sel))
            else:
                x = shared_tail(x, q, ok, ov, shared)
        return x
    return chain


chains = {"as_full": chain_full, "per-head, before": chain_per_head(False), "per-head, over logits": chain_per_head(True),
          "spec, 5 layers fall back": chain_spec(5), "spec, none falls back": chain_spec(0),
          "spec_gqa, 16 layers fall back": chain_spec_gqa(16)}
times = {name: [] for name in chains}
for fn in chains.values():
    jax.block_until_ready(fn())
for _ in range(7):
    for name, fn in chains.items():
        times[name] += timed(fn, 1)
base = np.median(times["as_full"])
for name, t in times.items():
    print(f"chain {name:28s} {np.median(t) * 1e3:8.1f} ms  {np.median(t) / base:5.3f}x as_full's"
          f"  (min {min(t) * 1e3:.1f}, max {max(t) * 1e3:.1f})")
