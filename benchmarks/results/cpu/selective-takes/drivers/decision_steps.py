"""One layer's decision steps at 4k prefix tokens, retention 0.25: itf_select over 3 probe rows, the 3 probes' scores,
per_head_select over 28 rows.

    python benchmarks/results/cpu/selective-takes/drivers/decision_steps.py
"""
import time, numpy as np, jax, jax.numpy as jnp
from specjax.engine import state as st
from specjax.kernels.probe_scores import probe_scores_reference
rng = np.random.default_rng(0)
L, m, k = 28, 4096, 1024
state = st.ImportanceState.init(L, m)
scores = jnp.asarray(rng.random((3, m)), jnp.float32)
def t(f, n=10):
    jax.block_until_ready(f()); jax.block_until_ready(f()); s = time.perf_counter()
    for _ in range(n): jax.block_until_ready(f())
    return (time.perf_counter() - s) / n * 1e3
print("itf_select ms", t(lambda: st.itf_select(state, 3, scores, k, m, None if False else 1.0, k_cap=k)))
q = jnp.asarray(rng.standard_normal((3, 48, 128)), jnp.bfloat16)
pk = jnp.asarray(rng.standard_normal((1, m, 128)), jnp.bfloat16)
ok = jnp.asarray(rng.standard_normal((1, 48, 128)), jnp.bfloat16)
print("probe scores ms", t(lambda: probe_scores_reference(q, pk, ok, kv_head_of_probe=(0, 0, 0), prefix_len=m, q_len=40)))
s28 = jnp.asarray(rng.random((28, m)), jnp.float32)
print("per_head_select ms", t(lambda: st.per_head_select(state, 3, s28, k, m, k_cap=k)))
