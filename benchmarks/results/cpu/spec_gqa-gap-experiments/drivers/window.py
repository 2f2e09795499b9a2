"""Main-thread stack samples (every 0.5 ms) inside each timed request's TTFT window; eval args."""
import collections, os, runpy, sys, threading, time
import numpy as np
from specjax.engine import layer_io

main_id = threading.main_thread().ident
samples = []
def sampler():
    while True:
        time.sleep(0.0005)
        f = sys._current_frames().get(main_id)
        t = time.monotonic()
        out = []
        while f is not None and len(out) < 40:
            out.append((os.path.basename(f.f_code.co_filename), f.f_lineno, f.f_code.co_name))
            f = f.f_back
        samples.append((t, out))
threading.Thread(target=sampler, daemon=True).start()
windows = []
orig = layer_io.Clock.exposed_host_ms
def exposed(self, io_busy):
    windows.append((self.start_monotonic, self.end_monotonic))
    return orig(self, io_busy)
layer_io.Clock.exposed_host_ms = exposed
OURS = ("engine", "layer_io", "identify", "prefetch", "pool", "reads", "steps", "state", "store", "kvarray", "speculation", "index", "caches", "landing", "scheduler", "selections", "itf", "probe_scores", "gathered_attention", "radix", "summaries")
def report():
    n = int(os.environ.get("LAST", "20"))
    ws = windows[-n:]
    ts = np.array([t for t, _ in samples])
    ours, leaf, top = collections.Counter(), collections.Counter(), collections.Counter()
    total = 0
    for a, b in ws:
        for i in range(np.searchsorted(ts, a), np.searchsorted(ts, b)):
            fr = samples[i][1]; total += 1
            own = [x for x in fr if x[0].removesuffix(".py") in OURS]
            ours[" < ".join(f"{x[2]} {x[0]}:{x[1]}" for x in own[:2])] += 1
            leaf[f"{fr[0][2]} {fr[0][0]}:{fr[0][1]} <- " + " < ".join(f"{x[2]} {x[0]}:{x[1]}" for x in own[:1])] += 1
            # outermost frame of ours below the engine's layer loop
            names = [x[2] for x in own]
            top[" > ".join(reversed(names[-4:]))] += 1
    win = sum(b - a for a, b in ws) * 1e3 / len(ws)
    scale = win / max(1, total / len(ws))
    print(f"TTFT window ms/request {win:.1f}, samples {total/len(ws):.0f}/request, {len(ws)} requests")
    print("-- innermost two frames of ours")
    for k, v in ours.most_common(40): print(f"  {v/len(ws)*scale:6.1f}  {k}")
    print("-- leaf <- ours")
    for k, v in leaf.most_common(30): print(f"  {v/len(ws)*scale:6.1f}  {k}")
    print("-- outer 4 of ours")
    for k, v in top.most_common(25): print(f"  {v/len(ws)*scale:6.1f}  {k}")
import atexit
atexit.register(report)
sys.argv = ["specjax.eval"] + sys.argv[1:]
runpy.run_module("specjax.eval", run_name="__main__", alter_sys=True)
