#!/bin/bash
# The second run of this record (37f8881: spec_mixed-kv8's probe keys are rows of its 8-bit K, not read apart), from
# the repository root:  bash benchmarks/results/cpu/kv-precision-whole-chunks-550/drivers/probe_rows.sh DATA OUT
# needle (32 requests: as_full, as_full-kv8 and spec_mixed-kv8 in one run), then the 550 items of drivers/accuracy.sh
# with spec_mixed-kv8, laid beside OUT/accuracy (the first run's, whose spec_mixed-kv8 read its probe keys apart:
# renamed spec_mixed-kv8-probe-apart) in OUT/accuracy-probe-rows.
set -e
DATA=$1 OUT=$2
python -m specjax.eval --task needle --prefix_tokens 1024 --limit 32 --systems as_full,as_full-kv8,spec_mixed-kv8 \
  --retention 0.25 --gpu_cache 0 --cpu_cache 0 --progress=false --output_dir "$OUT/needle-probe-rows"
python "$(dirname "$0")/agreement.py" "$OUT/needle-probe-rows" > "$OUT/needle-probe-rows/agreement.txt"
for task in piqa copa rte openbookqa; do
  python -m specjax.eval --task "$task" --data_dir "$DATA" --limit 150 --prefix_tokens 1024 \
    --systems spec_mixed-kv8 --retention 0.25 --gpu_cache 0 --cpu_cache 0 --progress=false \
    --output_dir "$OUT/new-probe-rows/$task"
  python benchmarks/results/cpu/kv-precision-550/drivers/merge.py "$OUT/accuracy/$task" "$OUT/new-probe-rows/$task" \
    "$OUT/accuracy-probe-rows/$task" --rename spec_mixed-kv8=spec_mixed-kv8-probe-apart
done
python benchmarks/pooled_accuracy.py "$OUT/accuracy-probe-rows" --reference as_full \
  --json "$OUT/accuracy-probe-rows/pooled.json" > "$OUT/accuracy-probe-rows/pooled.txt"
python "$(dirname "$0")/agreement.py" "$OUT/accuracy-probe-rows" > "$OUT/accuracy-probe-rows/agreement.txt"
