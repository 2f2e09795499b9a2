#!/bin/bash
# benchmarks/take_path.py (of the new tree) on the base and the new library, alternately, each alone
mkdir -p <this folder>
for i in 1 2; do
  for t in base new; do
    if [ $t = base ]; then dir=/work/wt-base; else dir=/work/main; fi
    cd $dir && . .venv/bin/activate
    python /work/main/benchmarks/take_path.py --output <this folder>/$t-$i-qwen.json > <this folder>/$t-$i-qwen.txt 2>&1
    python /work/main/benchmarks/take_path.py --model smollm2-135m --prefix_tokens 1024 --caches 0.15,0.5 \
      --policy spec_score --value_share 0.25 --output <this folder>/$t-$i-smol.json > <this folder>/$t-$i-smol.txt 2>&1
    deactivate
  done
done
echo ALLDONE > <this folder>/done
