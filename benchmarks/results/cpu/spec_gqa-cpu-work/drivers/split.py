# main thread samples during timed requests (EngineSystem.run via _Opened.prepare? no: timed = not warm), per request ms at 100 Hz
import collections, sys
path, depth = sys.argv[1], int(sys.argv[2]); anchor = sys.argv[3]; nreq = 40
c = collections.Counter(); tot = 0
for line in open(path):
    stack, _, n = line.rstrip().rpartition(" ")
    f = stack.split(";")
    if "MainThread" not in f[0] or any("warm" in x for x in f): continue
    idx = [i for i, x in enumerate(f) if x.split(" (")[0].endswith(anchor)]
    if not idx: continue
    rest = f[idx[0] + 1:]
    key = " > ".join(x.split(" (")[0] + ":" + x.rsplit(":", 1)[-1].rstrip(")") for x in rest[:depth]) or "<self>"
    c[key] += int(n); tot += int(n)
print(f"total ms/request under {anchor}: {tot*10/nreq:.1f}")
for k, v in c.most_common(int(sys.argv[4]) if len(sys.argv) > 4 else 25): print(f"{v*10/nreq:8.1f}  {k}")
