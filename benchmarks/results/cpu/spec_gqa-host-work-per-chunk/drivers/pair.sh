#!/bin/bash
# usage: pair.sh OUTDIR interval...  ; runs each interval once, in order
out=$1; shift
cd /work/main; . .venv/bin/activate
for si in "$@"; do
  python /tmp/drv/si.py $si --task piqa --data_dir ../shared/data --limit 40 --prefix_tokens 1024 --systems as_h2o_lfu,spec_gqa --retention 0.25 --progress=false --output_dir $out/si-$si-$(date +%H%M%S) > /dev/null 2>&1
done
