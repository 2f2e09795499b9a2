"""Per request of a requests.jsonl: TTFT, the bytes a device step chose that the device took from the caches'
pages, the bytes taken in all, disk bytes and ITF fallbacks; and whether two runs gave the same log-probabilities.

    python per_request.py after-4k/requests.jsonl [before-4k/requests.jsonl]
"""
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"{'system':10s} {'req':>3s} {'ttft ms':>8s} {'chosen on device MB':>20s} {'used MB':>8s} {'disk MB':>8s} fallbacks")
for r in rows:
    c = r["counters"]
    print(f"{r['system']:10s} {r['request_id']:3d} {r['ttft_ms']:8.1f} {c.get('chosen_on_device_bytes', 0) / 1e6:20.1f} "
          f"{c['used_token_bytes'] / 1e6:8.1f} {c['disk_bytes'] / 1e6:8.1f} {c['itf_fallbacks']}")
if len(sys.argv) > 2:
    other = {(r["system"], r["request_id"]): r["choice_logprobs"] for r in map(json.loads, open(sys.argv[2]))}
    same = sum(other[(r["system"], r["request_id"])] == r["choice_logprobs"] for r in rows)
    print(f"log-probabilities equal to the other run's: {same} of {len(rows)} requests")
