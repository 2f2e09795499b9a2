#!/bin/bash
# The timing shape (Qwen2.5-7B's KV geometry, random weights), needle 4k, O_DIRECT, caches off, the runs timed in
# turns:  bash drivers/timing.sh OUT
python -m specjax.eval --model timing-qwen2.5-7b --init random --dtype bfloat16 --task needle --prefix_tokens 4096 \
  --limit 4 --systems as_full,as_full-kv8,as_full-kv4,as_full-kv2 --direct_io --gpu_cache 0 --cpu_cache 0 \
  --interleave --progress=false --output_dir "$1"
