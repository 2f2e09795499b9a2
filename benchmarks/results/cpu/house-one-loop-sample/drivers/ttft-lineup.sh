#!/bin/bash
# alternate base and new, each alone on the machine
set -e
for round in 1 2; do
  for tree in base new; do
    cd /work/wt-$tree && . .venv/bin/activate
    python -m specjax.eval --task rag --systems full_reuse,cacheblend --limit 16 --blend_ratio 0.3 --blend_filter fixed --progress=false --output_dir /tmp/sample2/$tree-$round/rag > /tmp/sample2/$tree-$round-rag.log 2>&1
    deactivate
  done
done
for tree in base new; do
  cd /work/wt-$tree && . .venv/bin/activate
  python -m specjax.eval --task piqa --data_dir /work/shared/data --limit 12 --prefix_tokens 512 --systems as_full,cake --retention 0.25 --progress=false --output_dir /tmp/sample2/$tree-1/piqa > /tmp/sample2/$tree-1-piqa.log 2>&1
  deactivate
done
echo finished
