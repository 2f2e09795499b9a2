import time, jax, jax.numpy as jnp, numpy as np
from specjax.kernels import SharedIndices, gathered_attention
H, Hkv, d, m = 4, 4, 128, 4096
for n in (16, 32, 64):
  for dt in (jnp.bfloat16, jnp.float32):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((H, n, d)), dt)
    pk = jnp.asarray(rng.standard_normal((Hkv, m, d)), dt); pv = jnp.asarray(rng.standard_normal((Hkv, m, d)), dt)
    ok = jnp.asarray(rng.standard_normal((Hkv, n, d)), dt); ov = jnp.asarray(rng.standard_normal((Hkv, n, d)), dt)
    sel = SharedIndices(jnp.arange(m, dtype=jnp.int32), m)
    f = jax.jit(lambda q, pk, pv, ok, ov, sel: gathered_attention(q, pk, pv, ok, ov, sel, q_len=n, impl="auto", check_indices=False))
    jax.block_until_ready(f(q, pk, pv, ok, ov, sel))
    t = time.perf_counter()
    for _ in range(20): out = f(q, pk, pv, ok, ov, sel)
    jax.block_until_ready(out); ms = (time.perf_counter() - t) / 20 * 1e3
    flops = 4 * H * n * m * d
    print(f"n={n} {dt.__name__ if hasattr(dt,'__name__') else dt}: {ms:.2f} ms/layer, {flops/ms/1e6:.1f} GFLOP/s")
