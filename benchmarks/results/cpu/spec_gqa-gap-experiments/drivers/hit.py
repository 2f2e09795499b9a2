import time, numpy as np, jax, jax.numpy as jnp, ml_dtypes
from specjax.stores import prefetch as P, pool as PL
from specjax.stores.landing import BUFFERS
bf = ml_dtypes.bfloat16
def t(name, f, n=300):
    f(); t0 = time.perf_counter()
    for _ in range(n): out = f()
    jax.block_until_ready(out) if isinstance(out, jax.Array) else None
    print(f"{name:40s} {(time.perf_counter() - t0) / n * 1e6:8.1f} us"); return out
for c, nch in ((64, 17), (16, 68)):
    heads, d, size = 3, 64, 1088
    n = 1070
    chunks = [np.random.rand(heads, c, d).astype(bf) for _ in range(nch)]
    perm = np.random.permutation(nch * c)[:n]
    index, offsets, rows = perm // c, perm % c, np.arange(n)
    print(f"-- c={c}, {nch} host-hit chunks")
    st = t("np.stack", lambda: np.stack(chunks))
    stacked = np.stack(chunks)
    staged = P._staging((heads, size, d), bf, n)
    t("_staging", lambda: P._staging((heads, size, d), bf, n))
    t("_copy_rows", lambda: P._copy_rows(staged, rows, stacked, index, offsets))
    t("device_put staged", lambda: jax.device_put(staged))
    pages = jax.device_put(np.zeros((40, heads, c, d), np.uint16))
    slots = np.full(size, -1, np.int64)
    table = np.stack([slots, np.zeros(size, np.int64)]).astype(np.int32)
    dev = jax.device_put(staged)
    t("_gather (no page rows)", lambda: PL._gather(pages, table, dev, dtype=bf))
    buf = BUFFERS.empty((nch, heads, c, d), bf)
    def into():
        for i, a in enumerate(chunks): buf[i] = a
    t("copy chunks into landing buf (loop)", into)
    t("concatenate", lambda: np.concatenate(chunks).reshape(nch, heads, c, d))
    ext_table = np.stack([np.r_[index, -np.ones(size - n, int)], np.r_[offsets, np.zeros(size - n, int)]]).astype(np.int32)
    t("_gather from whole-chunk buffer", lambda: PL._gather(jax.device_put(buf), ext_table, None, dtype=bf))
