import json, sys, collections
def load(d):
    out = collections.defaultdict(dict)
    for line in open(d + "/requests.jsonl"):
        r = json.loads(line)
        out[r["system"]][r["request_id"]] = r
    return out
a, b = load(sys.argv[1]), load(sys.argv[2])
for run in a:
    ra, rb = a[run], b[run]
    assert ra.keys() == rb.keys()
    lp = all(ra[i]["choice_logprobs"] == rb[i]["choice_logprobs"] for i in ra)
    am = lambda r: max(range(len(r["choice_logprobs"])), key=r["choice_logprobs"].__getitem__)
    ans = all(am(ra[i]) == am(rb[i]) for i in ra)
    print(f"{run}: {len(ra)} requests, log-probabilities identical: {lp}, answers identical: {ans}")
