#!/bin/bash
# cake alone, base and new alternately, each alone on the machine
set -e
for round in 1 2; do
  for tree in base new; do
    cd /work/wt-$tree && . .venv/bin/activate
    python -m specjax.eval --task piqa --data_dir /work/shared/data --limit 24 --prefix_tokens 512 --systems cake --progress=false --output_dir /tmp/sample3/$tree-$round > /tmp/sample3/$tree-$round.log 2>&1 || true
    deactivate
  done
done
echo finished
