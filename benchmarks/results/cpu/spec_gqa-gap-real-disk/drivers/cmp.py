import collections, sys
def load(path):
    rows=[]
    for line in open(path):
        stack,_,n=line.rstrip().rpartition(" ")
        rows.append((stack.split(";"),int(n)))
    pre=[(f,n) for f,n in rows if any("runner.py:151" in x for x in f) and any("Engine._prefill" in x for x in f)]
    c=collections.Counter()
    for f,n in pre:
        seen=set()
        for x in f:
            a,_,w=x.partition(" (")
            k=a+" "+w.rstrip(")").rsplit("/",1)[-1]
            if k not in seen: seen.add(k); c[k]+=n
    return c
a=load("wall-spec_gqa.txt"); b=load("wall-as_h2o_lfu.txt")
keys=[k for k in set(a)|set(b) if any(s in k for s in ("prefetch.py","pool.py","caches.py","layer_io.py","steps.py","engine.py","reads.py","scheduler.py","__bool__","block_until_ready"))]
keys.sort(key=lambda k:-(a[k]+b[k]))
for k in keys[:45]:
    print(f"{a[k]/200/24*1e3:8.1f} {b[k]/200/24*1e3:8.1f}  {k}")
