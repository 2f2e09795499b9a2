#!/bin/bash
out=$1; shift
mkdir -p $out; cd /work/main; . .venv/bin/activate
for i in 1 2; do for mode in on off; do
python /tmp/drv/gcoff.py $mode --task piqa --data_dir /work/shared/data --limit 40 --prefix_tokens 1024 --systems as_h2o_lfu,spec_gqa --retention 0.25 --progress=false --output_dir $out/$mode-$i > $out/$mode-$i.log 2>&1
done; done
echo finished > $out/done
