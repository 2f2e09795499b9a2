"""Every request's choice log-probabilities and disk bytes, compared across runs of the same command."""
import json, sys, glob, os
def load(d):
    out = {}
    for line in open(os.path.join(d, "requests.jsonl")):
        j = json.loads(line)
        out[(j["system"], j["request_id"])] = (j["choice_logprobs"], j["counters"].get("disk_bytes"))
    return out
dirs = sorted(d for d in glob.glob(sys.argv[1] + "/*/") if os.path.exists(d + "requests.jsonl"))
ref = load(dirs[0])
for d in dirs[1:]:
    other = load(d)
    same_lp = sum(ref[k][0] == other[k][0] for k in ref)
    same_bytes = sum(ref[k][1] == other[k][1] for k in ref)
    print(f"{os.path.basename(d.rstrip('/'))} vs {os.path.basename(dirs[0].rstrip('/'))}: log-probabilities identical "
          f"in {same_lp}/{len(ref)} requests, disk bytes in {same_bytes}/{len(ref)}")
