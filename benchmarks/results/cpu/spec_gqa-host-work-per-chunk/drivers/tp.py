"""take path: wall and CPU (process, main thread) per request, median of N, for chunk 16 (smollm2 geometry)."""
import sys, time, statistics, tempfile, shutil, pathlib
sys.path.insert(0, "/work/main/benchmarks")
import numpy as np, jax
import take_path as tp
from specjax.stores import K, V, KVStore, Locations
from specjax.stores.caches import TieredCache
from specjax.stores.prefetch import Prefetcher

def run(chunk=16, requests=30, model="smollm2-135m", tokens=1024, share=0.25, caches=(0.15, 0.5), policy="spec_score"):
    layers, kv_heads, head_dim = tp.geometry(model)
    fp = {"arch": model, "num_layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "probe_heads": 0,
          "chunk_tokens": chunk, "dtype": "bfloat16"}
    kv = np.random.default_rng(0).standard_normal((kv_heads, tokens, head_dim)).astype(jax.numpy.bfloat16)
    path = tempfile.mkdtemp(prefix="tp-")
    with KVStore.open(path, fp) as store:
        store.insert(np.arange(tokens), [(kv, kv, None)] * layers)
    store = KVStore.open(path, fp)
    rb = layers * 2 * store.layout.token_nbytes(K) * tokens
    cache = TieredCache(int(caches[0] * rb), int(caches[1] * rb), policy, metrics=store.metrics)
    pf = Prefetcher(store, cache)
    positions = np.arange(tokens); rng = np.random.default_rng(1)
    walls, cpus, mains = [], [], []
    for i in range(requests + 2):
        match = store.match(positions)
        w, c, m = time.perf_counter(), time.process_time(), time.thread_time()
        every = [store.locate(match, positions, l) for l in range(layers)]
        for l in range(layers):
            pf.request(match, l, K, chunks=every[l].unique_chunks())
        for l in range(layers):
            pf.take(match, l, K, positions, pad_to=tokens, loc=every[l])
            chosen = np.sort(rng.choice(tokens, int(share * tokens), replace=False))
            loc = Locations(every[l].chunks[chosen], every[l].offsets[chosen])
            pf.request(match, l, V, chunks=loc.unique_chunks())
            jax.block_until_ready(pf.take(match, l, V, chosen, pad_to=tokens, loc=loc).array)
        w, c, m = time.perf_counter() - w, time.process_time() - c, time.thread_time() - m
        pf.close(); match.close()
        if i >= 2:
            walls.append(w); cpus.append(c); mains.append(m)
    store.close(); shutil.rmtree(path, ignore_errors=True)
    med = lambda x: statistics.median(x) * 1e3
    print(f"chunk {chunk}: wall {med(walls):.1f} ms, cpu {med(cpus):.1f} ms, main-thread cpu {med(mains):.1f} ms")

if __name__ == "__main__":
    run(int(sys.argv[1]) if len(sys.argv) > 1 else 16)
