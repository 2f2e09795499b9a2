import json, sys, statistics as st
for d in sys.argv[1:]:
    rows = [json.loads(l) for l in open(d + "/requests.jsonl")]
    by = {}
    for r in rows:
        by.setdefault(r["system"], {})[r["request_id"]] = r["ttft_ms"]
    a, b = by["as_h2o_lfu"], by["spec_gqa"]
    ratios = [b[k] / a[k] for k in a if k in b]
    print(d, "n", len(ratios), "median per-request ratio %.3f" % st.median(ratios), "mean-ratio %.3f" % (sum(b.values()) / sum(a.values())))
