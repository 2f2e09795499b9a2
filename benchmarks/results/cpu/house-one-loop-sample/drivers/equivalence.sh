#!/bin/bash
# usage: run.sh TREE OUT
set -e
cd $1 && . .venv/bin/activate
python -m specjax.eval --task rag --systems full_reuse,cacheblend --limit 16 --blend_ratio 0.3 --blend_filter fixed --progress=false --output_dir $2/rag > $2-rag.log 2>&1
python -m specjax.eval --task piqa --data_dir /work/shared/data --limit 12 --prefix_tokens 512 --systems as_full,spec_gqa,cake,planner --retention 0.25 --progress=false --output_dir $2/piqa > $2-piqa.log 2>&1
echo finished
