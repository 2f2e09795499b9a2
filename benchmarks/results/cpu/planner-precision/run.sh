#!/bin/bash
# The planner free to load at 8 or 4 bits (planner-plan4) beside recompute, as_full and as_full at 4 bits, on a disk
# emulated at 100 MB/s (bytes matter there), smollm2-135m, PIQA, 1024-token prefixes, timed in turns:
#   bash run.sh DATA OUT     (from the repository root)
python -m specjax.eval --task piqa --data_dir "$1" --limit 8 --prefix_tokens 1024 \
  --systems recompute,as_full,as_full-kv4,planner --plan_bits 4 --retention 0.25 --disk_bandwidth 100MB/s \
  --interleave --progress=false --output_dir "$2"
