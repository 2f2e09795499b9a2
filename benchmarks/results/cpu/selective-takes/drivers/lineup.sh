#!/bin/bash
# lineup.sh OUT PREFIX LIMIT SYSTEMS [flags]: the line-up of issue 67 on the timing shape (TRACE: the replayed selections)
out=$1; prefix=$2; limit=$3; systems=$4; shift 4
python -m specjax.eval --model timing-qwen2.5-7b --init random --dtype bfloat16 --task needle --prefix_tokens $prefix --limit $limit --systems $systems --retention 0.25 --replay_selections ${TRACE:-/tmp/traces/smollm2-needle} --direct_io --interleave --progress=false --output_dir $out "$@"
