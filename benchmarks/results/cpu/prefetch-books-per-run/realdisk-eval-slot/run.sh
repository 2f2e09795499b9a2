#!/bin/bash
# alternately: base (688907b) and new, each alone; real disk, page cache on, default caches: issue 38's PIQA line-up
for i in 1; do
  for t in base new; do
    if [ $t = base ]; then dir=/work/wt-base; else dir=/work/main; fi
    cd $dir && . .venv/bin/activate
    python -m specjax.eval --task piqa --data_dir /work/shared/data --limit 40 --prefix_tokens 1024 --retention 0.25 \
      --systems as_h2o_lfu,spec_gqa --progress=false --output_dir <this folder>/$t-$i > <this folder>/$t-$i.log 2>&1
    deactivate
  done
done
echo ALLDONE > <this folder>/done
