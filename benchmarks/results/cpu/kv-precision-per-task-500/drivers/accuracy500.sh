#!/bin/bash
# PIQA and OpenBookQA at 500 items (OpenBookQA's every item, PIQA's first 500) for as_full, spec and spec_mixed-kv8:
# smollm2-135m, 1024-token prefixes, retention 0.25, caches off, run from the repository root:
#   bash benchmarks/results/cpu/kv-precision-per-task-500/drivers/accuracy500.sh DATA OUT
set -e
DATA=$1 OUT=$2
for task in piqa openbookqa; do
  python -m specjax.eval --task "$task" --data_dir "$DATA" --limit 500 --prefix_tokens 1024 \
    --systems as_full,spec,spec_mixed-kv8 --retention 0.25 --gpu_cache 0 --cpu_cache 0 --progress=false \
    --output_dir "$OUT/$task"
done
python benchmarks/pooled_accuracy.py "$OUT" --reference as_full --json "$OUT/pooled.json" > "$OUT/pooled.txt"
