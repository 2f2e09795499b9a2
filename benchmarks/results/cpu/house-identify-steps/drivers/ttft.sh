#!/bin/bash
# usage: ttft.sh OUT ROUNDS: issue 38's spec_gqa command, base (/tmp/base) and new (/tmp/new) alternately, each alone
out=$1; rounds=$2
mkdir -p $out
for i in $(seq $rounds); do
  for tree in base new; do
    cd /tmp/$tree && . .venv/bin/activate
    python -m specjax.eval --task piqa --data_dir /work/shared/data --limit 40 --prefix_tokens 1024 \
      --systems as_h2o_lfu,spec_gqa --retention 0.25 --progress=false --interleave \
      --output_dir $out/$tree-$i > $out/$tree-$i.log 2>&1
    deactivate
  done
done
echo finished >> $out/done
