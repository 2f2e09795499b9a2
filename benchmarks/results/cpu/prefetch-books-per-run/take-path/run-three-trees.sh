#!/bin/bash
# three trees alternately, each alone: base 688907b, per-run books 54c0fb0, slot table (working tree)
for i in 1 2 3; do
  for t in base run slot; do
    case $t in base) dir=/work/wt-base;; run) dir=/work/wt-run;; slot) dir=/work/main;; esac
    cd $dir && . .venv/bin/activate
    python /work/main/benchmarks/take_path.py --chunk_tokens 16 --output <this folder>/$t-$i-qwen.json > <this folder>/$t-$i-qwen.txt 2>&1
    python /work/main/benchmarks/take_path.py --model smollm2-135m --prefix_tokens 1024 --caches 0.15,0.5 --chunk_tokens 16 \
      --policy spec_score --value_share 0.25 --requests 5 --output <this folder>/$t-$i-smol.json > <this folder>/$t-$i-smol.txt 2>&1
    deactivate
  done
done
echo ALLDONE > <this folder>/done
