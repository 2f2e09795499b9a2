import collections, sys
path = sys.argv[1]; outer = sys.argv[2]; inner = sys.argv[3]; nreq = 40
c = collections.Counter()
for line in open(path):
    stack, _, n = line.rstrip().rpartition(" ")
    f = stack.split(";")
    if "MainThread" not in f[0] or any("warm" in x for x in f): continue
    o = [x for x in f if x.split(" (")[0].endswith(outer)]
    if not o or not any(inner in x for x in f): continue
    c[o[0].split(" (")[0] + ":" + o[0].rsplit(":", 1)[-1].rstrip(")")] += int(n)
for k, v in c.most_common(): print(f"{v*10/nreq:8.1f}  {k}")
