import time, numpy as np
from specjax.stores.caches import TieredCache
c = TieredCache(1<<30, 1<<31, "spec_score")
arr = np.zeros((4, 16, 128), np.uint16)
keys = [(l, k, i) for l in range(28) for k in (0, 1) for i in range(256)]
for key in keys[::3]: c.tiers["host"].put(key, arr, (0.0, 0))
for key in keys[1::5]: c.tiers["device"].put(key, arr, (0.0, 0))
per = [[(l, k, i) for i in range(256)] for l in range(28) for k in (0, 1)]
for rep in range(3):
    t = time.perf_counter()
    for ks in per:
        c.lookup_many(ks, [16] * 256, chunk_tokens=16, importance=np.ones(256))
    dt = time.perf_counter() - t
    c._later.clear()
    print(f"{dt*1e3:.1f} ms for {len(keys)} lookups: {dt/len(keys)*1e6:.2f} us/key")
# key building in prefetch.take
chunks = np.arange(256)
t = time.perf_counter()
for l in range(28):
    for k in (0, 1):
        ks = [(l, k, int(x)) for x in chunks]
        cnt = np.bincount(np.arange(256) % 256, minlength=256).tolist()
dt = time.perf_counter() - t
print(f"keys+counts: {dt/len(keys)*1e6:.2f} us/key")
