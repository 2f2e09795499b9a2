#!/bin/bash
# The 4k line-up of this record, run from the repository root in its venv (traces from benchmarks/record_traces.sh):
#   bash drivers/lineup.sh OUT
python -m specjax.eval --model timing-qwen2.5-7b --init random --dtype bfloat16 --task needle --prefix_tokens 4096 \
  --limit 4 --systems as_full,as_h2o_lfu,spec,spec_gqa --retention 0.25 \
  --replay_selections /tmp/traces/smollm2-needle --direct_io --interleave --progress=false --output_dir "$1"
