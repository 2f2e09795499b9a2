"""Time LocalFiles._read_many and ChunkReads._check_run (by thread kind) during an eval."""
import atexit, collections, sys, runpy, threading, time
from specjax.stores import landing as L, reads as R, prefetch as P
T = collections.defaultdict(float); N = collections.Counter(); B = collections.Counter()
def wrap(obj, attr, name, nb=None):
    fn = getattr(obj, attr)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            th = "main" if threading.current_thread() is threading.main_thread() else threading.current_thread().name.split("_")[0]
            T[(name, th)] += time.perf_counter() - t; N[(name, th)] += 1
    setattr(obj, attr, w)
wrap(L.LocalFiles, "_read_many", "read_many")
wrap(R.ChunkReads, "_check_run", "check_run")
wrap(R.ChunkReads, "_verify", "verify")
wrap(P.Prefetcher, "take", "take")
wrap(P.Prefetcher, "_hold", "hold")
def report():
    for k in sorted(T): print(f"  {k}: {T[k]*1e3:.0f} ms, {N[k]} calls, {T[k]*1e6/max(N[k],1):.0f} us/call", file=sys.stderr)
atexit.register(report)
sys.argv = ["specjax.eval"] + sys.argv[1:]
runpy.run_module("specjax.eval", run_name="__main__", alter_sys=True)
