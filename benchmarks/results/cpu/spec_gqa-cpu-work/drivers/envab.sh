#!/bin/bash
# usage: envab.sh OUT ROUNDS : alternate SPECJAX_INLINE=0 and =1 in /work/main, interleaved eval
out=$1; rounds=$2; shift 2
mkdir -p $out
cd /work/main; . .venv/bin/activate
for i in $(seq $rounds); do
  for v in 0 1; do
    SPECJAX_INLINE=$v python -m specjax.eval --task piqa --data_dir /work/shared/data --limit 40 --prefix_tokens 1024 --systems as_h2o_lfu,spec_gqa --retention 0.25 --progress=false --interleave --output_dir $out/inline$v-$i "$@" > $out/inline$v-$i.log 2>&1
  done
done
echo finished >> $out/done
