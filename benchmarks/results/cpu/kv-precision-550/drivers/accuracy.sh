#!/bin/bash
# The accuracy and disk bytes of this record: smollm2-135m, 1024-token prefixes, retention 0.25, caches off, run from
# the repository root:  bash drivers/accuracy.sh DATA OUT
# OpenBookQA and PIQA on their first 150 items with every system of the line-up; COPA (its 100 items) and RTE (its
# first 150) with spec_mixed-kv8 only, whose requests are then laid beside the other systems' answers to the same
# requests in ../kv-precision-store/accuracy (`drivers/merge.py` checks that the requests are the same).
run() {
  python -m specjax.eval --task "$1" --data_dir "$DATA" --limit 150 --prefix_tokens 1024 --systems "$2" \
    --retention 0.25 --gpu_cache 0 --cpu_cache 0 --progress=false --output_dir "$OUT/$1"
}
DATA=$1 OUT=$2
run openbookqa as_full,as_full-kv8,as_full-kv4,spec,spec_mixed-kv8
run piqa as_full,as_full-kv8,as_full-kv4,spec,spec_mixed-kv8
run copa spec_mixed-kv8
run rte spec_mixed-kv8
