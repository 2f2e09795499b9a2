#!/bin/bash
for round in 1 2; do
  for tree in wt-new main; do
    cd /work/$tree && . .venv/bin/activate
    python -m specjax.eval --task piqa --data_dir /work/shared/data --limit 24 --prefix_tokens 512 --systems cake --progress=false --output_dir /tmp/sample4/$tree-$round > /tmp/sample4/$tree-$round.log 2>&1 || true
    deactivate
  done
done
echo finished
