"""Process CPU time (all threads) from a request's clock start to its first token, by system (last W requests)."""
import atexit, collections, sys, runpy, time, threading
import numpy as np
from specjax.engine import layer_io as LIO, engine as E
W = int(sys.argv[1]); del sys.argv[1]
rows = collections.defaultdict(list)
cur = threading.local()
oinit, ofinish = LIO.Clock.__init__, LIO.Clock.finish
def init(self):
    oinit(self); self._cpu0 = time.process_time(); self._th0 = time.thread_time()
def finish(self):
    cpu = (time.process_time() - self._cpu0) * 1e3; th = (time.thread_time() - self._th0) * 1e3
    out = ofinish(self)
    rows[cur.name].append((cpu, th, out[0]))
    return out
LIO.Clock.__init__, LIO.Clock.finish = init, finish
orun = E.Engine.run
def run(self, request):
    cur.name = self.system.name
    return orun(self, request)
E.Engine.run = run
def report():
    for name, v in rows.items():
        a = np.array(v[-W:])
        print(f"{name}: last {len(a)}: process cpu to first token {a[:,0].mean():.1f} ms (median {np.median(a[:,0]):.1f}); main thread cpu {a[:,1].mean():.1f}; ttft {a[:,2].mean():.1f}; cpu/ttft {a[:,0].mean()/a[:,2].mean():.2f}", file=sys.stderr)
atexit.register(report)
sys.argv = ["specjax.eval"] + sys.argv[1:]
runpy.run_module("specjax.eval", run_name="__main__", alter_sys=True)
