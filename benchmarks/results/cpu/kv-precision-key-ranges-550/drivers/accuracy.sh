#!/bin/bash
# The accuracy and disk bytes of this record: smollm2-135m, 1024-token prefixes, retention 0.25, caches off, run from
# the repository root:  bash benchmarks/results/cpu/kv-precision-key-ranges-550/drivers/accuracy.sh DATA OUT
# PIQA (its first 150 items), COPA (its 100), RTE and OpenBookQA (their first 150) with the systems that read low-bit KV; their
# requests are then laid beside as_full's and spec's answers to the same requests in ../kv-precision-550/accuracy
# (full precision: nothing they read changed) by ../kv-precision-550/drivers/merge.py, which checks that every request
# is the same.
set -e
DATA=$1 OUT=$2
HERE=benchmarks/results/cpu/kv-precision-550
for task in piqa copa rte openbookqa; do
  python -m specjax.eval --task "$task" --data_dir "$DATA" --limit 150 --prefix_tokens 1024 \
    --systems as_full-kv8,as_full-kv4,spec_mixed-kv8 --retention 0.25 --gpu_cache 0 --cpu_cache 0 --progress=false \
    --output_dir "$OUT/new/$task"
  python $HERE/drivers/merge.py $HERE/accuracy/$task "$OUT/new/$task" "$OUT/accuracy/$task"
done
python benchmarks/pooled_accuracy.py "$OUT/accuracy" --reference as_full --json "$OUT/accuracy/pooled.json" \
  > "$OUT/accuracy/pooled.txt"
