#!/bin/bash
# usage: ab.sh OUT ROUNDS [extra eval args...] : alternate base (/tmp/base) and new (/work/main)
out=$1; rounds=$2; shift 2
mkdir -p $out
for i in $(seq $rounds); do
  for tree in base main; do
    if [ $tree = base ]; then cd /tmp/base; else cd /work/main; fi
    . .venv/bin/activate
    python -m specjax.eval --task piqa --data_dir /work/shared/data --limit 40 --prefix_tokens 1024 --systems as_h2o_lfu,spec_gqa --retention 0.25 --progress=false --output_dir $out/$tree-$i "$@" > $out/$tree-$i.log 2>&1
    deactivate
  done
done
echo finished >> $out/done
