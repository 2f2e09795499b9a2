#!/bin/bash
# ab_asfull.sh OUT TREE...: as_full and as_h2o_lfu on the Qwen2.5-7B timing shape, default caches, O_DIRECT, per tree in order given
OUT=$1; shift; mkdir -p $OUT; i=0
for T in "$@"; do i=$((i+1)); name=$(basename $T)-$i
  (cd $T && .venv/bin/python -m specjax.eval --model timing-qwen2.5-7b --init random --dtype bfloat16 --task needle --prefix_tokens 4096 --limit 4 --systems as_full,as_h2o_lfu,spec --retention 0.25 --replay_selections /work/main/.traces/smollm2-needle --direct_io --progress=false --interleave --output_dir $OUT/$name > $OUT/$name.log 2>&1)
  echo "$name $(python3 -c "
import json; r=json.load(open('$OUT/$name/results.json'))['systems']
print(' '.join(f\"{k} {v['ttft_ms']['mean']:.1f}\" for k,v in r.items()))")"
done
