import collections, runpy, sys, time, os, atexit
import numpy as np
from specjax.stores import prefetch
from specjax.engine import layer_io
stats = []
cur = {}
orig_hold = prefetch.Prefetcher._hold
def _hold(self, layer, kind, chunks, demand, background=False):
    if demand and cur.get("in_take"):
        table = self._table(layer, kind)
        slots = table.find(np.asarray(chunks, np.int64))
        cur["new"] = int((slots < 0).sum()); cur["held"] = int((slots >= 0).sum())
        held = slots[slots >= 0]
        cur["spec_held"] = int(table.speculative[held].sum())
    return orig_hold(self, layer, kind, chunks, demand, background)
prefetch.Prefetcher._hold = _hold
orig_take = prefetch.Prefetcher.take
def take(self, match, layer, kind, positions, **kw):
    cur.clear(); cur["in_take"] = True
    out = orig_take(self, match, layer, kind, positions, **kw)
    stats.append((kind, cur.get("new", 0), cur.get("held", 0), cur.get("spec_held", 0), out.waited_ms))
    cur.clear()
    return out
prefetch.Prefetcher.take = take
def report():
    s = stats[-int(os.environ.get("LASTT", "1200")):]
    for kind in (0, 1):
        rows = [r for r in s if r[0] == kind]
        with_new = [r for r in rows if r[1] > 0]; without = [r for r in rows if r[1] == 0]
        print(f"kind {kind}: takes {len(rows)}, with new demand reads {len(with_new)} (mean new chunks {np.mean([r[1] for r in with_new]) if with_new else 0:.1f}, wait {np.mean([r[4] for r in with_new]) if with_new else 0:.2f} ms); without {len(without)} (held {np.mean([r[2] for r in without]) if without else 0:.1f} of which speculative {np.mean([r[3] for r in without]) if without else 0:.1f}, wait {np.mean([r[4] for r in without]) if without else 0:.2f} ms)")
atexit.register(report)
sys.argv = ["specjax.eval"] + sys.argv[1:]
runpy.run_module("specjax.eval", run_name="__main__", alter_sys=True)
