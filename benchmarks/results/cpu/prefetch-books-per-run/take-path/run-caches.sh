#!/bin/bash
for i in 1 2 3; do
  for t in base new; do
    if [ $t = base ]; then dir=/work/wt-base; else dir=/work/main; fi
    cd $dir && . .venv/bin/activate
    python /work/main/benchmarks/take_path.py --model smollm2-135m --prefix_tokens 1024 --caches 0.15,0.5 \
      --policy spec_score --value_share 0.25 --chunk_tokens 16,16 --requests 5 --output <this folder>/$t-$i.json > <this folder>/$t-$i.txt 2>&1
    deactivate
  done
done
echo ALLDONE > <this folder>/done
