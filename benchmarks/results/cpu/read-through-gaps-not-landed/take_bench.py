"""The prefetcher's take path alone, at SmolLM2-135M's KV shape (30 layers, 3 KV heads of 64, bf16, 1024 stored
tokens), no model: per request, every layer's keys requested at its start (the certain reads of H2O and of spec_gqa on
this model), then per layer a take of all its keys and of a random quarter of its values. Caches 15% / 50% of the
request's KV, filled by a first, untimed request; the median of three timed requests. Runs on the tree of the patch in
this folder (it needs `KVStore(read_gap_bytes=...)`); OPEN='{"read_gap_bytes": 0}' etc. chooses the store option.

    OPEN='{"read_gap_bytes": 0}' python take_bench.py
"""
import json
import os
import tempfile
import time

import ml_dtypes
import numpy as np

from specjax.stores import K, V, KVStore
from specjax.stores.caches import TieredCache
from specjax.stores.prefetch import Prefetcher

L, H, D, T = 30, 3, 64, 1024
OPEN = json.loads(os.environ.get("OPEN", "{}"))


def run(chunk, policy, gpu_frac=0.15, cpu_frac=0.5, reps=3):
    fp = {"arch": "t", "num_layers": L, "kv_heads": H, "head_dim": D, "probe_heads": 0, "chunk_tokens": chunk,
          "dtype": "bfloat16"}
    rng = np.random.default_rng(0)
    kv = [(rng.standard_normal((H, T, D)).astype(ml_dtypes.bfloat16),) * 2 + (None,) for _ in range(L)]
    d = tempfile.mkdtemp()
    with KVStore.open(d, fp) as store:
        store.insert(np.arange(T), kv)
    store = KVStore.open(d, fp, **OPEN)
    total = L * 2 * H * T * D * 2
    cache = TieredCache(int(gpu_frac * total), int(cpu_frac * total), policy, metrics=store.metrics)
    pf = Prefetcher(store, cache)
    pos = np.arange(T)
    rng = np.random.default_rng(1)
    times = []
    for rep in range(reps + 1):
        if rep == 1:
            store.metrics.reset()
        match = store.match(np.arange(T))
        t0 = time.perf_counter()
        for layer in range(L):
            pf.request(match, layer, K, pos)
        for layer in range(L):
            pf.take(match, layer, K, pos, pad_to=T)
            pf.take(match, layer, V, np.sort(rng.choice(T, T // 4, replace=False)), pad_to=T // 4)
        t1 = time.perf_counter()
        pf.close()
        match.close()
        if rep:
            times.append(t1 - t0)
    m = store.metrics.snapshot()
    store.close()
    return np.median(times) * 1e3, m, reps


for chunk in (64, 16):
    for policy in ("lfu", "spec_score"):
        ms, m, reps = run(chunk, policy)
        print(f"chunk {chunk:2d} {policy:10s} OPEN={OPEN}: {ms:6.1f} ms per request; per request: "
              f"{m['read_requests'] / reps:.0f} reads, {m['disk_bytes'] / reps / 1e6:.2f} MB "
              f"(gap {m['gap_bytes'] / reps / 1e6:.2f}), misses {m['misses'] / reps:.0f}", flush=True)
