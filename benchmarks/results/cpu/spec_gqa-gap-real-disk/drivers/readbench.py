import sys, time, tempfile, shutil, concurrent.futures, statistics
import numpy as np, jax
from specjax.stores import K, V, KVStore
layers, kvh, hd, tokens, chunk = 28, 4, 128, 4096, 16
fp = {"arch": "x", "num_layers": layers, "kv_heads": kvh, "head_dim": hd, "probe_heads": 0, "chunk_tokens": chunk, "dtype": "bfloat16"}
kv = np.random.default_rng(0).standard_normal((kvh, tokens, hd)).astype(jax.numpy.bfloat16)
path = tempfile.mkdtemp()
with KVStore.open(path, fp) as st:
    st.insert(np.arange(tokens), [(kv, kv, None)] * layers)
st = KVStore.open(path, fp)
m = st.match(np.arange(tokens))
locs = [st.locate(m, np.arange(tokens), l) for l in range(layers)]
for rep in range(3):
    t = time.perf_counter()
    runs = []
    for l in range(layers):
        ch = locs[l].unique_chunks()[::2]  # every other chunk: one read each
        runs += st.read_runs(l, V, ch)
    concurrent.futures.wait([r.verified for r in runs])
    dt = time.perf_counter() - t
    print(f"{len(runs)} reads: {dt*1e3:.1f} ms, {dt/len(runs)*1e6:.1f} us/read")
m.close(); st.close(); shutil.rmtree(path)
