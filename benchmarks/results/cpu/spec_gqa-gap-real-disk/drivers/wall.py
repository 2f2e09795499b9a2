import collections, sys
path, = sys.argv[1:2]
rows=[]
for line in open(path):
    stack,_,n=line.rstrip().rpartition(" ")
    rows.append((stack.split(";"),int(n)))
timed=[(f,n) for f,n in rows if any("runner.py:151" in x for x in f)]
# up to first token: under Engine._prefill
pre=[(f,n) for f,n in timed if any("Engine._prefill" in x for x in f)]
def name(x):
    a,_,w=x.partition(" (")
    return a+" "+w.rstrip(")").rsplit("/",1)[-1]
def incl(rs, depth_from="Engine._prefill"):
    c=collections.Counter()
    for f,n in rs:
        seen=set()
        for x in f:
            k=name(x)
            if k not in seen:
                seen.add(k); c[k]+=n
    return c
rate=200; req=24
print("timed total ms/req", sum(n for _,n in timed)/rate/req*1e3, "prefill", sum(n for _,n in pre)/rate/req*1e3)
c=incl(pre)
for k,v in c.most_common(45):
    print(f"{v/rate/req*1e3:8.1f}  {k}")
