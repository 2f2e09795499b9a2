#!/bin/bash
# Issue 72's evaluation: PIQA 16 items, 512-token prefixes, every system, at retention 0.25: 2 processes x 2 CPU
# devices (--tensor_parallel 4 over both) against one process with 4 devices.
# The model: tiny-llama's shape with 8 query heads over 4 KV heads (one per device), random weights (model/).
# Usage: bash benchmarks/results/cpu/processes-piqa16/run.sh   (OUT=/tmp/processes-piqa16 by default)
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-/tmp/processes-piqa16}
M=benchmarks/results/cpu/processes-piqa16/model
SYS=recompute,as_full,as_h2o_lru,as_h2o_lfu,impress,spec,spec_mixed,spec_gqa,contiguous_kv,cake,planner,cacheblend
COMMON="--model $M --init random --task piqa --data_dir ../shared/data --limit 16 --prefix_tokens 512 --systems $SYS
        --retention 0.25 --tensor_parallel 4 --noprogress"
rm -rf "$OUT"; mkdir -p "$OUT"
export JAX_PLATFORMS=cpu
XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m specjax.eval $COMMON --store "$OUT/s1" \
    --output_dir "$OUT/one" > "$OUT/one.log" 2>&1 || exit 1
PORT=$((20000 + RANDOM % 20000))
for i in 0 1; do
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m specjax.eval $COMMON --store "$OUT/s2" \
      --output_dir "$OUT/two" --num_processes 2 --process_id $i --coordinator localhost:$PORT > "$OUT/two$i.log" 2>&1 &
done
wait
python benchmarks/results/cpu/processes-piqa16/compare.py "$OUT/one" "$OUT/two"
