"""Each take of a benchmarks/data_path.py run, counted by (kind, tokens, padded size, runs, landing buffers, is each
buffer present, share of the one buffer's tokens the take needs, any cache hit); run as data_path.py is, from a tree."""
import collections, runpy, sys, atexit
import numpy as np
from specjax.stores import prefetch as P
orig = P.Prefetcher._assemble
stats = collections.Counter()
def _assemble(self, layer, kind, chunks, inverse, offsets, size, cached, runs):
    ext = {id(r.extent): r.extent for r in runs}
    whole = [e is not None and getattr(e, "whole", True) for e in ext.values()]  # `whole`: before 73ba4df
    frac = None
    if len(ext) == 1 and whole[0]:
        e = list(ext.values())[0]
        frac = round(len(inverse) / (e.array.shape[0] * self.store.layout.chunk_tokens), 2)
    stats[(kind, len(inverse), size, len(runs), len(ext), tuple(whole), frac, bool(cached))] += 1
    return orig(self, layer, kind, chunks, inverse, offsets, size, cached, runs)
P.Prefetcher._assemble = _assemble
def rep():
    paths = collections.Counter()
    for (kind, n, size, runs, buffers, present, share, hit), v in stats.items():
        whole = buffers == 1 and present[0] and share is not None and share >= 0.5 and not hit
        paths[(kind, f"{buffers} buffer(s)", "buffer crosses whole" if whole else "rows copied on the host")] += v
    for k, v in sorted(paths.items()):
        print("PATH", v, k)
    for k, v in sorted(stats.items(), key=lambda kv: -kv[1])[:40]:
        print("TAKE", v, k)
atexit.register(rep)
sys.argv = ["data_path.py"] + sys.argv[1:]
runpy.run_path("benchmarks/data_path.py", run_name="__main__")
