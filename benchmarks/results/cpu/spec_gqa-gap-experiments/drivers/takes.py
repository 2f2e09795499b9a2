"""Per take: system, kind, phase, positions, chunks, hits, from disk, waited ms, take ms (LayerIO.take whole)."""
import collections, runpy, sys, time, os, json
import numpy as np
from specjax.engine import layer_io
from specjax.stores import prefetch
log = []
cur = {}
orig_pt = prefetch.Prefetcher.take
def pt(self, match, layer, kind, positions, **kw):
    t = time.perf_counter()
    out = orig_pt(self, match, layer, kind, positions, **kw)
    cur.update(pt_ms=(time.perf_counter() - t) * 1e3, waited=out.waited_ms, disk=out.chunks_from_disk)
    return out
prefetch.Prefetcher.take = pt
orig_lt = layer_io.LayerIO.take
def lt(self, layer, kind, positions, pad_to, phase="kv_io_stall", importance=None):
    cur.clear()
    t = time.perf_counter()
    out = orig_lt(self, layer, kind, positions, pad_to, phase, importance)
    loc = self.locate(layer, positions)
    log.append(dict(layer=layer, kind=kind, phase=phase, n=len(positions), chunks=len(loc.chunk_index[0]),
                    ms=(time.perf_counter() - t) * 1e3, start=self.clock.start_monotonic, **cur))
    return out
layer_io.LayerIO.take = lt
def report():
    starts = sorted({r["start"] for r in log})
    last = set(starts[-int(os.environ.get("LAST", "20")):])
    rows = [r for r in log if r["start"] in last]
    agg = collections.defaultdict(lambda: collections.Counter())
    for r in rows:
        a = agg[(r["kind"], r["phase"])]
        a["takes"] += 1
        for k in ("n", "chunks", "ms", "pt_ms", "waited", "disk"): a[k] += r.get(k, 0)
    n = len(last)
    print(f"{n} requests; per request:")
    for key, a in sorted(agg.items()):
        print(key, {k: round(v / n, 1) for k, v in a.items()})
import atexit; atexit.register(report)
sys.argv = ["specjax.eval"] + sys.argv[1:]
runpy.run_module("specjax.eval", run_name="__main__", alter_sys=True)
