#!/bin/bash
# usage: equivalence.sh TREE OUT   (each tree in its own worktree and venv; run one tree at a time, alone)
set -e
cd $1 && . .venv/bin/activate
python -m specjax.eval --task rag --systems full_reuse,cacheblend --limit 16 --progress=false --output_dir $2/rag > $2-rag.log 2>&1
python -m specjax.eval --task piqa --data_dir /work/shared/data --limit 24 --prefix_tokens 512 \
  --systems recompute,as_full,as_h2o_lru,as_h2o_lfu,impress,spec,spec_gqa,contiguous_kv,cake,planner --retention 0.25 \
  --progress=false --output_dir $2/piqa > $2-piqa.log 2>&1
echo finished
