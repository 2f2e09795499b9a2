"""Patch Prefetcher.take phases with timers (monkeypatch at import), print per-request ms per kind at exit.
Use: python /tmp/drv/instrument.py <eval args>"""
import atexit, collections, sys, time, runpy
import numpy as np
from specjax.stores import prefetch as P
T = collections.defaultdict(float); N = collections.Counter()
orig_take, orig_hold, orig_assemble = P.Prefetcher.take, P.Prefetcher._hold, P.Prefetcher._assemble
import concurrent.futures as cf
orig_wait = cf.wait
def timed(name, fn):
    def w(self, *a, **k):
        t = time.perf_counter()
        try:
            return fn(self, *a, **k)
        finally:
            kind = a[1] if name != "take" else a[2]
            T[(name, kind)] += time.perf_counter() - t
            N[(name, kind)] += 1
    return w
import threading
TL = threading.local()
def take(self, match, layer, kind, *a, **k):
    TL.kind = kind
    try:
        return timed("take", orig_take)(self, match, layer, kind, *a, **k)
    finally:
        TL.kind = None
P.Prefetcher.take = take
def wait(fs, *a, **k):
    kind = getattr(TL, "kind", None)
    t = time.perf_counter()
    try:
        return orig_wait(fs, *a, **k)
    finally:
        if kind is not None:
            T[("wait", kind)] += time.perf_counter() - t; N[("wait", kind)] += 1
cf.wait = wait
P.Prefetcher._assemble = timed("assemble", orig_assemble)
def hold(self, layer, kind, chunks, demand, background=False):
    t = time.perf_counter()
    try:
        return orig_hold(self, layer, kind, chunks, demand, background)
    finally:
        T[("hold-" + ("demand" if demand else "spec"), kind)] += time.perf_counter() - t
P.Prefetcher._hold = hold
from specjax.stores import pool as PL
def tfun(name, obj, attr):
    fn = getattr(obj, attr)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            T[(name, -1)] += time.perf_counter() - t; N[(name, -1)] += 1
    setattr(obj, attr, w)
tfun("pool.gather", PL.DevicePool, "gather")
tfun("pool.gather_extent", PL.DevicePool, "gather_extent")
tfun("pool._to_device", PL.DevicePool, "_to_device")
tfun("pool._write_pending", PL.DevicePool, "_write_pending")
tfun("pool.pin_many", PL.DevicePool, "pin_many")
tfun("pool.unpin", PL.DevicePool, "unpin")
tfun("pool.compile", PL.DevicePool, "compile")
tfun("np.stack", P.np, "stack")
def report():
    print("per-request ms (divide by requests):", file=sys.stderr)
    for k in sorted(T): print(f"  {k}: total {T[k]*1e3:.0f} ms, calls {N[k]}", file=sys.stderr)
atexit.register(report)
sys.argv = ["specjax.eval"] + sys.argv[1:]
runpy.run_module("specjax.eval", run_name="__main__", alter_sys=True)
