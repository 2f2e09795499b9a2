#!/bin/bash
out=$1; rounds=$2; shift 2
mkdir -p $out
cd /tmp/new && . .venv/bin/activate
for r in $(seq 1 $rounds); do
  for si in "$@"; do
    SI=$si python /tmp/ab/si.py --task piqa --data_dir /work/shared/data --limit 40 --prefix_tokens 1024 --systems as_h2o_lfu,spec_gqa --retention 0.25 --progress=false --interleave --output_dir $out/si$si-$r > $out/si$si-$r.log 2>&1
  done
done
echo finished > $out/done
