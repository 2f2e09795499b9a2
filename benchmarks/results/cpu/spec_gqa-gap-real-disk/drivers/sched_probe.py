import sys, time, statistics, collections
sys.path.insert(0, "benchmarks")
import numpy as np
from specjax.stores import scheduler as S
log = []
orig_take, orig_deliver = S.ReadScheduler._take_ready, S.ReadScheduler._deliver
def take_ready(self):
    ready = orig_take(self)
    now = time.monotonic()
    for r in ready:
        r._issued_at = now
        r._inflight_at_issue = self._inflight_bytes
    return ready
def deliver(self, read, disk):
    t = time.monotonic()
    orig_deliver(self, read, disk)
    log.append((read.queued_at, getattr(read, "_issued_at", None), t, time.monotonic(), read.nbytes, read.speculative, self.max_inflight_bytes))
S.ReadScheduler._take_ready = take_ready
S.ReadScheduler._deliver = deliver
import take_path
chunk = int(sys.argv[1])
row = take_path.measure("qwen2.5-7b", 4096, chunk, caches=(0.15, 0.5), policy="spec_score", value_share=0.25, requests=3)
print(row)
log = log[len(log)//2:]
q = [i - a for a, i, d, e, n, s, m in log]
f = [d - i for a, i, d, e, n, s, m in log]
cb = [e - d for a, i, d, e, n, s, m in log]
print("reads", len(log), "bytes mean", statistics.mean(n for *_, n, s, m in log))
for name, xs in (("queued->issued", q), ("issued->landed", f), ("deliver cb", cb)):
    xs = sorted(xs)
    print(f"{name}: median {statistics.median(xs)*1e3:.3f} ms p90 {xs[int(.9*len(xs))]*1e3:.3f} mean {statistics.mean(xs)*1e3:.3f}")
print("max_inflight", log[-1][-1])
