#!/bin/bash
# usage: ab.sh OUTDIR ROUNDS TREE_A TREE_B ...
out=$1; rounds=$2; shift 2
mkdir -p $out
for r in $(seq 1 $rounds); do
  for t in "$@"; do
    name=$(basename $t)
    cd $t && . .venv/bin/activate && python -m specjax.eval --task piqa --data_dir /work/shared/data --limit 40 --prefix_tokens 1024 --systems as_h2o_lfu,spec_gqa --retention 0.25 --progress=false --interleave --output_dir $out/$name$r > $out/$name$r.log 2>&1
    deactivate
  done
done
echo finished > $out/done
