import collections, sys
path, req = sys.argv[1], int(sys.argv[2])
rate=200
rows=[]
for line in open(path):
    stack,_,n=line.rstrip().rpartition(" ")
    rows.append((stack.split(";"),int(n)))
pre=[(f,n) for f,n in rows if any("runner.py:166" in x for x in f) and any("Engine._prefill " in x for x in f)]
def name(x):
    a,_,w=x.partition(" (")
    return a+" "+w.rstrip(")").rsplit("/",1)[-1]
c=collections.Counter()
for f,n in pre:
    seen=set()
    for x in f:
        k=name(x)
        if k not in seen:
            seen.add(k); c[k]+=n
print("prefill ms/req", sum(n for _,n in pre)/rate/req*1e3)
for k,v in c.most_common(int(sys.argv[3]) if len(sys.argv)>3 else 70):
    print(f"{v/rate/req*1e3:8.1f}  {k}")
