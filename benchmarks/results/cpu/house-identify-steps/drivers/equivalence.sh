#!/bin/bash
# usage: equivalence.sh TREE OUT: the sample of every identification (and the candidate stage) in one tree
set -e
cd $1 && . .venv/bin/activate
python -m specjax.eval --task piqa --data_dir /work/shared/data --limit 12 --prefix_tokens 512 \
  --systems as_full,as_h2o_lfu,impress,spec,spec_gqa,contiguous_kv,planner,cake --retention 0.25 --progress=false \
  --output_dir $2/piqa > $2-piqa.log 2>&1
python -m specjax.eval --task piqa --data_dir /work/shared/data --limit 12 --prefix_tokens 512 \
  --systems spec_gqa --gqa_candidates 2 --retention 0.25 --progress=false \
  --output_dir $2/piqa-candidates > $2-piqa-candidates.log 2>&1
echo finished
