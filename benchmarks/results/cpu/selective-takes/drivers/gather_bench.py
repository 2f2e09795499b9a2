"""One take's device steps, 30% of its rows in device pages and the rest in the host tier's pages: the gather reading
the host pages in place (a CPU device) against their rows copied into a host array that then crosses.

    python benchmarks/results/cpu/selective-takes/drivers/gather_bench.py
"""
import time, numpy as np, jax, ml_dtypes
from specjax.stores.pool import _gather, staged_size
from specjax.stores.prefetch import _copy_rows
from specjax.stores.landing import BUFFERS
rng = np.random.default_rng(0)
bf = ml_dtypes.bfloat16
def case(heads, size, n_dev_slots, n_host_slots, dev_share):
    pages = jax.device_put(np.zeros((n_dev_slots + 1, heads, 64, 128), np.uint16))
    host_np = np.zeros((n_host_slots, heads, 64, 128), np.uint16)
    host = jax.device_put(host_np)
    on_dev = rng.random(size) < dev_share
    slots = np.where(on_dev, rng.integers(0, n_dev_slots, size), -1)
    hslots = np.where(~on_dev, rng.integers(0, n_host_slots, size), -1)
    offs = rng.integers(0, 64, size)
    t_in = np.stack([slots, offs, np.full(size, -1), hslots]).astype(np.int32)
    def inplace():
        return _gather(pages, t_in, None, host, dtype=bf)
    hr = np.flatnonzero(~on_dev); ss = staged_size(size, len(hr))
    at = np.full(size, -1); at[hr] = np.arange(len(hr))
    t_cp = np.stack([slots, offs, at, np.full(size, -1)]).astype(np.int32)
    def copy():
        st = BUFFERS.empty((heads, ss, 128), bf)
        _copy_rows(st, np.arange(len(hr)), host_np.view(bf), hslots[hr], offs[hr])
        return _gather(pages, t_cp, jax.device_put(st), None, dtype=bf)
    res = {}
    for f in (inplace, copy): f().block_until_ready(); f().block_until_ready()
    for _ in range(10):
        for f in (inplace, copy):
            t = time.perf_counter(); f().block_until_ready(); res.setdefault(f.__name__, []).append((time.perf_counter()-t)*1e3)
    print(heads, size, {k: round(float(np.median(v)), 2) for k, v in res.items()})
case(1, 16384, 560, 1900, 0.3)
case(4, 4096, 140, 460, 0.3)
case(4, 1024, 140, 460, 0.3)
