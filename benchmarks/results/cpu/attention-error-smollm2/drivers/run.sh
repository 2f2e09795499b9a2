#!/bin/bash
# This record's runs, from the repository root:  bash benchmarks/results/cpu/attention-error-smollm2/drivers/run.sh DATA OUT
# smollm2-135m, 1024-token prefixes: needle's 32 requests, then the first 12 requests (ordered by prefix) of COPA and
# PIQA; every variant layer by layer, the default --chains end to end; then needle with the mixed rest's keys at 8 bits
# (values at 4), and keys or values alone at 4 bits run end to end.
set -e
DATA=$1 OUT=$2
python benchmarks/attention_error.py --task needle --requests 32 --data_dir "$DATA" --out "$OUT/needle"
for task in copa piqa; do
  python benchmarks/attention_error.py --task "$task" --requests 12 --data_dir "$DATA" --out "$OUT/$task"
done
python benchmarks/attention_error.py --task needle --requests 32 --rest_key_bits 8 --chains "K4,V4,mixed engine" \
  --data_dir "$DATA" --out "$OUT/needle-rest-keys-8"
