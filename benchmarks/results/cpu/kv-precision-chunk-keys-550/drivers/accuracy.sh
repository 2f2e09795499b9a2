#!/bin/bash
# The accuracy and disk bytes of this record: smollm2-135m, 1024-token prefixes, retention 0.25, caches off, run from
# the repository root:  bash drivers/accuracy.sh DATA OUT
# RTE (its first 150 items) with every system of the line-up. COPA (its 100), OpenBookQA and PIQA (their first 150)
# with the systems that read low-bit KV (PIQA without as_full-kv8: the session's time), whose requests are then laid beside as_full's and spec's answers to the same
# requests in ../kv-precision-550/accuracy (full precision: nothing they read changed), by
# ../kv-precision-550/drivers/merge.py, which checks that every request is the same.
run() {
  python -m specjax.eval --task "$1" --data_dir "$DATA" --limit 150 --prefix_tokens 1024 --systems "$2" \
    --retention 0.25 --gpu_cache 0 --cpu_cache 0 --progress=false --output_dir "$OUT/$3/$1"
}
DATA=$1 OUT=$2
HERE=benchmarks/results/cpu/kv-precision-550
run rte as_full,as_full-kv8,as_full-kv4,spec,spec_mixed-kv8 accuracy
run copa as_full-kv4,spec_mixed-kv8,as_full-kv8 new
run openbookqa as_full-kv4,spec_mixed-kv8,as_full-kv8 new
run piqa as_full-kv4,spec_mixed-kv8 new
for task in copa openbookqa; do
  python $HERE/drivers/merge.py $HERE/accuracy/$task "$OUT/new/$task" "$OUT/accuracy/$task"
done
python $HERE/drivers/merge.py $HERE/accuracy/piqa "$OUT/new/piqa" "$OUT/accuracy/piqa" --drop as_full-kv8
python benchmarks/pooled_accuracy.py "$OUT/accuracy" --reference as_full --json "$OUT/accuracy/pooled.json" \
  > "$OUT/accuracy/pooled.txt"
python benchmarks/results/cpu/kv-precision-chunk-keys-550/drivers/without.py "$OUT/accuracy" "$OUT/no-kv8" as_full-kv8
python benchmarks/pooled_accuracy.py "$OUT/no-kv8" --reference as_full --json "$OUT/accuracy/pooled-550.json" \
  > "$OUT/accuracy/pooled-550.txt"
