#!/bin/bash
# usage: ab_ttft.sh BASE_TREE NEW_TREE OUT ROUNDS
# Old and new code cannot share one process, so one `--interleave` run cannot hold both: the two trees' runs take
# turns instead (base, new, base, new, ...), each run interleaving its systems request by request, alone on the machine.
set -e
for round in $(seq 1 $4); do
  for tree in base new; do
    dir=$1; [ $tree = new ] && dir=$2
    ( cd $dir && . .venv/bin/activate && \
      python -m specjax.eval --task piqa --data_dir /work/shared/data --limit 24 --prefix_tokens 512 \
        --systems recompute,as_full,spec,spec_gqa,cake --retention 0.25 --interleave --progress=false \
        --output_dir $3/$tree-$round > $3/$tree-$round.log 2>&1 )
    echo "$tree $round done $(date +%T)"
  done
done
