"""Every request's choice log-probabilities and disk bytes of one run against earlier runs, system by system.
usage: same_requests.py NEW_DIR OLD_DIR... (each an evaluation's --output_dir, with its requests.jsonl)"""
import json
import sys


def load(d):
    out = {}
    for line in open(f"{d}/requests.jsonl"):
        j = json.loads(line)
        out[(j["system"], j["request_id"])] = (j["choice_logprobs"], j["counters"].get("disk_bytes"))
    return out


new = load(sys.argv[1])
for ref in sys.argv[2:]:
    old = load(ref)
    for system in sorted({s for s, _ in new}):
        keys = [k for k in old if k[0] == system and k in new]
        if keys:
            lp = sum(new[k][0] == old[k][0] for k in keys)
            b = sum(new[k][1] == old[k][1] for k in keys)
            print(f"{ref}: {system} log-probabilities identical {lp}/{len(keys)}, disk bytes {b}/{len(keys)}")
