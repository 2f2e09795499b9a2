"""The two host steps this record changed, alone, on the Qwen2.5-7B timing shape's geometry (4 KV heads of 128,
bf16, 64-token chunks, 4,096 tokens): a per-head layer's union (np.unique against idsets.distinct), and a take's host
rows (a fresh np.zeros filled by fancy indexing and crossed, against a reused landing buffer filled by
prefetch._copy_rows), 56 takes a request as on that shape, their device arrays alive until the request ends."""
import time

import jax
import ml_dtypes
import numpy as np

from specjax.idsets import distinct
from specjax.stores.landing import BUFFERS
from specjax.stores.prefetch import _copy_rows, _staging


def per_call_ms(f, repeats=300):
    f()
    t = time.perf_counter()
    for _ in range(repeats):
        f()
    return (time.perf_counter() - t) / repeats * 1e3


rng = np.random.default_rng(0)
chosen = np.sort(rng.integers(0, 4096, (4, 1024)).astype(np.int32), axis=1)  # four heads' top-1,024
print(f"numpy {np.__version__}, jax {jax.__version__}")
print(f"union of 4 x 1,024 positions: np.unique {per_call_ms(lambda: np.unique(chosen)):.3f} ms, "
      f"distinct {per_call_ms(lambda: distinct(chosen)):.3f} ms")

bf16 = ml_dtypes.bfloat16
n, heads, c, d = 64, 4, 64, 128
chunks = rng.standard_normal((n, heads, c, d)).astype(bf16)
positions = np.sort(rng.choice(n * c, 3500, replace=False))
index, offsets = positions // c, positions % c
size, rows = 4096, np.arange(len(positions))
device = jax.devices()[0]


def fresh():
    staged = np.zeros((heads, size, d), bf16)
    staged[:, rows] = chunks[index, :, offsets].swapaxes(0, 1)
    return jax.device_put(staged, device)


def reused():
    staged = _staging((heads, size, d), bf16, len(rows))
    _copy_rows(staged, rows, chunks, index, offsets)
    return jax.device_put(staged, device)


assert (np.asarray(fresh()) == np.asarray(reused())).all()
for name, f in (("fresh np.zeros", fresh), ("landing buffer", reused)) * 2:
    for request in range(6):
        t = time.perf_counter()
        alive = [f() for _ in range(56)]
        jax.block_until_ready(alive)
        ms = (time.perf_counter() - t) / 56 * 1e3
        del alive
    print(f"take of {len(rows)} rows into {size}: {name} {ms:.3f} ms a take (the 6th request of 56 takes)")
print("landing buffers:", BUFFERS.stats)
