#!/bin/bash
# The accuracy and disk bytes of this record: smollm2-135m, 1024-token prefixes, caches off, run from the repository
# root:  bash drivers/accuracy.sh DATA OUT
# COPA (its 100 items) and RTE on their first 150 items; OpenBookQA and PIQA on their first 60 (the session's time).
run() {
  python -m specjax.eval --task "$1" --data_dir "$DATA" --limit "$2" --prefix_tokens 1024 \
    --systems as_full,as_full-kv8,as_full-kv4,spec,spec_mixed,spec_mixed-kv8 --retention 0.25 \
    --gpu_cache 0 --cpu_cache 0 --progress=false --output_dir "$OUT/$1"
}
DATA=$1 OUT=$2
run copa 150; run rte 150; run openbookqa 60; run piqa 60
python benchmarks/pooled_accuracy.py "$OUT" --reference as_full --json "$OUT/pooled.json" > "$OUT/pooled.txt"
