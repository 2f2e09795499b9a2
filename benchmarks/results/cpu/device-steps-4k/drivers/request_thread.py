"""Where a timed request's prefill spends the request thread's time, from a py-spy profile taken with --idle: samples
blocked on the device (`block_until_ready`, an array's `__bool__` / value) apart, the rest by project frame
(inclusive: nested frames overlap).

    py-spy record --idle --nonblocking --format raw --rate 200 -o spec_only.txt -- python -m specjax.eval \
        --model timing-qwen2.5-7b --init random --dtype bfloat16 --task needle --prefix_tokens 4096 --limit 4 \
        --systems spec --retention 0.25 --replay_selections TRACE --direct_io --progress=false --output_dir OUT
    python request_thread.py spec_only.txt "Engine._prefill_block" 0.8    # 0.8 = rate 200 x 4 requests / 1000
"""
import collections
import re
import sys

path, under, div = sys.argv[1], sys.argv[2], float(sys.argv[3])
total, n, wait = collections.Counter(), 0, 0
for line in open(path):
    stack, _, count = line.rstrip().rpartition(" ")
    count, frames = int(count), stack.split(";")
    if not any(under in f for f in frames) or not any("EngineSystem.run " in f for f in frames):
        continue
    n += count
    if any(("block_until_ready" in f) or ("__bool__" in f) or ("_value (jax" in f) for f in frames):
        wait += count
        continue
    seen = set()
    for f in frames:
        g = re.sub(r":\d+\)", ")", f)
        if g not in seen:
            seen.add(g)
            total[g] += count
print("ms per request: in", under, round(n / div), "of which blocked on the device", round(wait / div))
for frame, count in total.most_common(60):
    if any(s in frame for s in ("specjax/", "stores/", "kernels/", "eval/")):
        print(round(count / div, 1), frame[:120])
