#!/bin/bash
# alternately: base (688907b) and new, each alone; O_DIRECT, timing-qwen2.5-7b, caches off
for i in 1 2; do
  for t in base new; do
    if [ $t = base ]; then dir=/work/wt-base; else dir=/work/main; fi
    cd $dir && . .venv/bin/activate
    python -m specjax.eval --model timing-qwen2.5-7b --init random --task needle --limit 3 --prefix_tokens 4096 \
      --systems as_h2o_lfu,spec_gqa --retention 0.25 --gpu_cache 0 --cpu_cache 0 --direct_io --progress=false \
      --output_dir <this folder>/$t-$i > <this folder>/$t-$i.log 2>&1
    deactivate
  done
done
echo ALLDONE > <this folder>/done
