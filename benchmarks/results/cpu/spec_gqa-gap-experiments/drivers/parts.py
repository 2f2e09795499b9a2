"""Wall time per request spent (on the main thread) in named functions, timed requests only."""
import collections, runpy, sys, time, os, threading
import numpy as np
from specjax.engine import layer_io, identify, engine as eng, steps
from specjax.stores import prefetch, pool, caches, reads, store as store_mod
main = threading.main_thread()
acc = collections.Counter(); depth = collections.Counter()
def wrap(owner, name, label=None):
    f = getattr(owner, name); label = label or f"{owner.__name__}.{name}"
    def w(*a, **k):
        if threading.current_thread() is not main: return f(*a, **k)
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[label] += time.perf_counter() - t; depth[label] += 1
    setattr(owner, name, w)
wrap(prefetch.Prefetcher, "take"); wrap(prefetch.Prefetcher, "_assemble"); wrap(prefetch.Prefetcher, "_hold")
wrap(prefetch.Prefetcher, "_release"); wrap(prefetch.Prefetcher, "request")
wrap(prefetch, "_copy_rows"); wrap(prefetch, "_staging"); wrap(prefetch.Prefetcher, "_place_hits"); wrap(store_mod.KVStore, "landings"); wrap(reads.ChunkReader, "_extents")
wrap(pool.DevicePool, "gather"); wrap(pool.DevicePool, "gather_extent"); wrap(pool.DevicePool, "pin_many"); wrap(pool.DevicePool, "unpin")
wrap(caches.TieredCache, "lookup_many"); wrap(caches.TieredCache, "admit_later")
wrap(layer_io.LayerIO, "take"); wrap(layer_io.LayerIO, "locate"); wrap(layer_io.LayerIO, "select"); wrap(layer_io.LayerIO, "identify")
wrap(layer_io.LayerIO, "_wait_planned"); wrap(layer_io.Clock, "device_wait")
_np_stack = np.stack
def stack(*a, **k):
    t = time.perf_counter()
    try: return _np_stack(*a, **k)
    finally:
        if threading.current_thread() is main: acc["np.stack"] += time.perf_counter() - t; depth["np.stack"] += 1
prefetch.np.stack = stack  # prefetch's np is numpy module: patch globally
snap = []
orig = layer_io.Clock.exposed_host_ms
def exposed(self, io_busy):
    snap.append((self.end_monotonic - self.start_monotonic, dict(acc), dict(depth)))
    return orig(self, io_busy)
layer_io.Clock.exposed_host_ms = exposed
def report():
    n = int(os.environ.get("LAST", "20"))
    a0, d0 = snap[-n-1][1], snap[-n-1][2]
    a1, d1 = snap[-1][1], snap[-1][2]
    print(f"TTFT ms/request {sum(s[0] for s in snap[-n:]) / n * 1e3:.1f}")
    for k in sorted(a1, key=lambda k: -(a1[k] - a0.get(k, 0))):
        print(f"  {(a1[k]-a0.get(k,0))/n*1e3:7.1f} ms  {(d1[k]-d0.get(k,0))/n:7.1f} calls  {k}")
import atexit; atexit.register(report)
sys.argv = ["specjax.eval"] + sys.argv[1:]
runpy.run_module("specjax.eval", run_name="__main__", alter_sys=True)
