#!/bin/bash
set -e
for tree in base new; do
  ( cd /tmp/eq/$tree && . .venv/bin/activate && python -m specjax.eval --task piqa --data_dir /work/shared/data --limit 24 --prefix_tokens 512 \
      --systems spec_mixed --no_prefetch --retention 0.25 --progress=false --output_dir /tmp/eq/out/$tree/piqa-spec_mixed-no_prefetch > /tmp/eq/out/$tree-piqa-spec_mixed-no_prefetch.log 2>&1 )
  echo "$tree done $(date +%T)"
done
