#!/bin/bash
# The accuracy and disk bytes of this record: smollm2-135m, 1024-token prefixes, retention 0.25, caches off, run from
# the repository root:  bash benchmarks/results/cpu/kv-precision-whole-chunks-550/drivers/accuracy.sh DATA OUT
# PIQA (its first 150 items), COPA (its 100), RTE and OpenBookQA (their first 150) with spec_mixed-kv8, which now loads
# the chunks its selection touches whole at 8 bits and only the others' values at 4 (its keys at 8 all along); its
# requests are then laid beside ../kv-precision-rest-keys-550's (as_full, as_full-kv8, as_full-kv4, spec, and both
# spec_mixed-kv8s of before, which laid the selected rows alone over every position's low-bit rows, renamed
# spec_mixed-kv8-rows and spec_mixed-kv8-restk4-rows) by ../kv-precision-550/drivers/merge.py, which checks that every
# request is the same.
set -e
DATA=$1 OUT=$2
OLD=benchmarks/results/cpu/kv-precision-rest-keys-550/accuracy
for task in piqa copa rte openbookqa; do
  python -m specjax.eval --task "$task" --data_dir "$DATA" --limit 150 --prefix_tokens 1024 \
    --systems spec_mixed-kv8 --retention 0.25 --gpu_cache 0 --cpu_cache 0 --progress=false \
    --output_dir "$OUT/new/$task"
  python benchmarks/results/cpu/kv-precision-550/drivers/merge.py $OLD/$task "$OUT/new/$task" "$OUT/accuracy/$task" \
    --rename spec_mixed-kv8=spec_mixed-kv8-rows,spec_mixed-kv8-restk4=spec_mixed-kv8-restk4-rows
done
python benchmarks/pooled_accuracy.py "$OUT/accuracy" --reference as_full --json "$OUT/accuracy/pooled.json" \
  > "$OUT/accuracy/pooled.txt"
python "$(dirname "$0")/agreement.py" "$OUT/accuracy" > "$OUT/accuracy/agreement.txt"
