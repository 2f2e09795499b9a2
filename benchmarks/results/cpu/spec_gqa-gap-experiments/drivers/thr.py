"""CPU time per thread group per timed request (last N)."""
import collections, os, runpy, sys, threading, re
from specjax.engine import layer_io
TCK = os.sysconf("SC_CLK_TCK")
def snap():
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = open(f"/proc/self/task/{tid}/stat").read()
            comm = open(f"/proc/self/task/{tid}/comm").read().strip()
        except OSError: continue
        f = stat.rsplit(")", 1)[1].split()
        cpu = (int(f[11]) + int(f[12])) / TCK
        name = names.get(int(tid), comm)
        name = re.sub(r"[_-]?\d+$", "", name)
        out[tid] = (name, cpu)
    return out
per = []
orig_init = layer_io.Clock.__init__
def init(self, *a, **k):
    orig_init(self, *a, **k); self._snap = snap()
layer_io.Clock.__init__ = init
orig = layer_io.Clock.exposed_host_ms
def exposed(self, io_busy):
    end = snap(); d = collections.Counter()
    for tid, (name, cpu) in end.items():
        d[name] += cpu - self._snap.get(tid, (name, 0.0))[1]
    per.append(d)
    return orig(self, io_busy)
layer_io.Clock.exposed_host_ms = exposed
def report():
    n = int(os.environ.get("LAST", "20")); tot = collections.Counter()
    for d in per[-n:]: tot.update(d)
    print(f"CPU ms per request by thread group ({n} requests):")
    for k, v in tot.most_common(): print(f"  {v/n*1e3:7.1f}  {k}")
import atexit; atexit.register(report)
sys.argv = ["specjax.eval"] + sys.argv[1:]
runpy.run_module("specjax.eval", run_name="__main__", alter_sys=True)
