#!/usr/bin/env bash
# Record, on a CPU, the selection traces the GPU session replays (benchmarks/gpu_session.sh; issue 40): what
# smollm2-135m's identification saw on needle (1k-token prefixes, 4 requests: as many as the GPU steps run at 4k),
# for every system that identifies there. Carry the folder to the GPU machine (git ignores .traces/).
#
#   bash benchmarks/record_traces.sh [FOLDER]        # default .traces/smollm2-needle; a few minutes on 2 cores
set -eu
TRACE=${1:-.traces/smollm2-needle}
PY=${PYTHON:-python3}
$PY -m specjax.eval --model smollm2-135m --task needle --prefix_tokens 1024 --limit 4 \
  --systems as_h2o_lfu,impress,spec,spec_gqa,planner --retention 0.25 --progress=false \
  --record_selections "$TRACE" --output_dir "results/record-smollm2-needle"
du -sh "$TRACE"
