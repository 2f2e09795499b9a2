"""Where the host time nothing overlapped goes: an in-process sampler of the main thread's stack (every 0.5 ms),
the samples that fall in the intervals no disk read, device wait or device work covered (last N requests)."""
import collections, os, pathlib, runpy, sys, threading, time
import numpy as np
from specjax.engine import layer_io

main_id = threading.main_thread().ident
samples = []  # (t, frames)
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

gaps_all = []
orig = layer_io.Clock.exposed_host_ms
def exposed(self, io_busy):
    self._all_work_noted()
    busy = list(self._device_busy)
    start, end = self.start_monotonic, self.end_monotonic
    covered = sorted((max(a, start), min(b, end)) for a, b in io_busy + self._device_waits + busy if b > start and a < end)
    gaps, reach = [], start
    for a, b in covered:
        if a > reach:
            gaps.append((reach, a))
        reach = max(reach, b)
    if end > reach:
        gaps.append((reach, end))
    gaps_all.append(gaps)
    return orig(self, io_busy)
layer_io.Clock.exposed_host_ms = exposed

OURS = ("engine", "layer_io", "identify", "prefetch", "pool", "reads", "steps", "state", "store", "kvarray", "speculation", "index", "caches", "landing", "scheduler")
def report():
    n = int(os.environ.get("LAST", "4"))
    gaps = [g for req in gaps_all[-n:] for g in req]
    ts = np.array([t for t, _ in samples])
    leaf, ours, by_leaf = collections.Counter(), collections.Counter(), collections.Counter()
    total = 0
    for a, b in gaps:
        for i in range(np.searchsorted(ts, a), np.searchsorted(ts, b)):
            fr = samples[i][1]
            total += 1
            leaf[f"{fr[0][2]} {fr[0][0]}:{fr[0][1]}"] += 1
            own = [x for x in fr if x[0].removesuffix(".py") in OURS]
            ours[" < ".join(f"{x[2]} {x[0]}:{x[1]}" for x in own[:2])] += 1
            by_leaf[f"{fr[0][2]} {fr[0][0]}:{fr[0][1]} <- " + " < ".join(f"{x[2]} {x[0]}:{x[1]}" for x in own[:1])] += 1
    gap_ms = sum(b - a for a, b in gaps) * 1e3 / n
    print(f"exposed ms/request {gap_ms:.1f}, samples in gaps {total} ({total/n:.0f}/request)")
    scale = gap_ms / max(1, total / n)
    print("-- innermost two frames of ours (ms/request)")
    for k, v in ours.most_common(30): print(f"  {v/n*scale:6.1f}  {k}")
    print("-- leaf frame")
    for k, v in leaf.most_common(15): print(f"  {v/n*scale:6.1f}  {k}")
    print("-- by leaf, the calling frames")
    for k, v in by_leaf.most_common(25): print(f"  {v/n*scale:6.1f}  {k}")
import atexit
atexit.register(report)
sys.argv = ["data_path.py"] + sys.argv[1:]
runpy.run_path(str(pathlib.Path(__file__).resolve().parents[4] / "data_path.py"), run_name="__main__")
