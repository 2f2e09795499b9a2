"""A line-up's systems against an earlier record's: accuracy, mean TTFT, disk MB a request, spec's byte and TTFT
ratios, and whether every request's log-probabilities and disk bytes are the same.
usage: lineup.py NEW_DIR OLD_DIR"""
import json
import sys


def load(d):
    r = json.load(open(f"{d}/results.json"))["systems"]
    reqs = {}
    for line in open(f"{d}/requests.jsonl"):
        q = json.loads(line)
        reqs.setdefault(q.get("system"), []).append(q)
    return r, reqs


new, old = (load(d) for d in sys.argv[1:3])
for tag, (r, _) in (("new", new), ("old", old)):
    row = []
    for name in ("as_h2o_lfu", "impress", "spec"):
        s = r[name]
        row.append(f"{name} acc {s['accuracy']['acc']:.3f} TTFT {s['ttft_ms']['mean']:.1f} ms "
                   f"MB {s['io']['disk_bytes'] / s['accuracy']['n'] / 1e6:.2f}")
    b = {n: r[n]['io']['disk_bytes'] for n in ("as_h2o_lfu", "impress", "spec")}
    t = {n: r[n]['ttft_ms']['mean'] for n in ("as_h2o_lfu", "impress", "spec")}
    print(tag, "; ".join(row), f"| spec/impress bytes {b['spec'] / b['impress']:.3f}, spec/as_h2o_lfu bytes "
          f"{b['spec'] / b['as_h2o_lfu']:.3f}, spec/impress TTFT {t['spec'] / t['impress']:.3f}")
for name in ("as_h2o_lfu", "impress", "spec"):
    a, b = new[1].get(name, []), old[1].get(name, [])
    keys = [k for k in ("logprobs", "choice_logprobs", "scores") if a and k in a[0]]
    same_lp = all(x.get(keys[0]) == y.get(keys[0]) for x, y in zip(a, b)) if keys else None
    same_bytes = sum(x["counters"]["disk_bytes"] == y["counters"]["disk_bytes"] for x, y in zip(a, b))
    print(f"{name}: {len(a)} requests; log-probabilities ({keys[:1]}) identical: {same_lp}; disk bytes identical in "
          f"{same_bytes} of {len(a)}")
