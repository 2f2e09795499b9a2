"""Summarise a read_calls.py log: calls, runs per call, run sizes and the gaps between the runs of one call."""
import json, sys, collections
import numpy as np
recs = [json.loads(l) for l in open(sys.argv[1])]
for spec in (False, True):
    rs = [r for r in recs if r["spec"] == spec]
    nruns = np.array([len(r["runs"]) for r in rs])
    gaps = []
    sizes = []
    for r in rs:
        runs = sorted(r["runs"])
        for (s1, f1, n1), (s2, f2, n2) in zip(runs, runs[1:]):
            if s1 == s2:
                gaps.append(f2 - (f1 + n1))
        sizes += [n for _, _, n in runs]
    gaps = np.array(gaps); sizes = np.array(sizes)
    print(f"spec={spec}: calls {len(rs)}, runs {nruns.sum()}, runs/call mean {nruns.mean():.2f} max {nruns.max()}, "
          f"by kind {collections.Counter(r['kind'] for r in rs)}")
    print("  run sizes (chunks) pct 10/50/90:", np.percentile(sizes, [10, 50, 90]))
    if len(gaps):
        print("  gaps (chunks) pct 10/50/90:", np.percentile(gaps, [10, 50, 90]), "<=1:", (gaps <= 1).mean(), "<=4:", (gaps <= 4).mean(), "<=8:", (gaps<=8).mean())
    print("  chunk bytes", set(r["chunk_bytes"] for r in rs))
