#!/bin/bash
# usage: dp.sh OUTDIR ROUNDS SYSTEMS TREE...  -- alternating benchmarks/data_path.py runs of the trees, each alone
out=$1; rounds=$2; systems=$3; shift 3
mkdir -p $out
for r in $(seq 1 $rounds); do
  for t in "$@"; do
    name=$(basename $t)
    cd $t && . .venv/bin/activate && python benchmarks/data_path.py --model timing-qwen2.5-7b --limit 4 --systems $systems --output $out/$name$r.json > $out/$name$r.log 2>&1
    deactivate
  done
done
echo finished > $out/done
