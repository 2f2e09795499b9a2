#!/usr/bin/env bash
# The GPU runs in phases, each sized to fit one 10-minute device call with the install (issue 40). The first matters
# most; run the others as device time allows.
#
#   core      the machine's limits (disk O_DIRECT rate, host-to-device, bf16 matmul) and the host-to-device rates of a
#             take's buffers (benchmarks/host_transfer.py: pageable, registered for DMA, pinned_host), then
#             recompute, as_full, spec, cake, the planner and spec_gqa on Qwen2.5-7B's shape (random weights, bf16),
#             needle with 16k and then 4k-token prefixes, O_DIRECT reads, selections replayed from smollm2-135m's;
#             then recompute, as_full, spec and spec_gqa at 30k (Qwen2.5-7B takes 32,768 tokens in all). Its limits
#             add to 890 s: in one 10-minute call, DEADLINE=540 gives the 4k and 30k steps what the others leave
#   more      as_h2o_lfu and impress at 4k and 16k
#   precision low-bit KV (issue 70) on Qwen2.5-7B's shape, needle 16k and 4k, O_DIRECT: recompute, as_full, as_full
#             at 4 bits, spec_mixed-kv8 (selection and probe keys at 8 bits, the rest at 4) and the planner free to
#             load at 8 or 4 bits (--plan_bits 4: planner-plan4)
#   opt       OPT-6.7B's shape at 4k: recompute, as_full, spec, cake, the planner, as_h2o_lfu
#   emulated  core's line-up at 4k on a disk emulated at the SPEC paper's measured 5 GB/s (read from the page cache
#             through --disk_bandwidth; results say it is emulated)
#   tests     the @pytest.mark.gpu tests (Pallas kernels compiled through Triton)
#   kernels   the kernel benchmark (Pallas vs the jnp reference vs dense attention; Qwen2.5-7B's heads packed
#             per group against a tile per head)
#
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh core                  # on the GPU machine
#   TINY=1 OUT=/tmp/gpu-tiny bash benchmarks/gpu_session.sh core more opt emulated   # on a CPU, in a few minutes
#   DEADLINE=540 OUT=$OUT/s bash benchmarks/gpu_session.sh core emulated more   # phases in order until 540 s
#
# Selections: a random-weight model's attention has no structure (every ITF layer falls back), so the systems that
# identify decide from what smollm2-135m's identification saw on the same task (benchmarks/record_traces.sh writes
# them, on a CPU, into $TRACE; carry that folder to the GPU machine). TINY=1 uses tiny shapes, records its own trace
# from a random tiny model first, and needs no carried trace.
#
# Every step runs under its own time limit (cut to what DEADLINE leaves) and logs to $OUT/logs; each evaluation
# prints its progress to its log and keeps every finished system in <output_dir>/.partial until its results are
# written, so a step cut off at its limit leaves what it finished (a rerun of the step on the same machine runs only
# the rest: --resume). $OUT/results.tgz holds the results and logs after every step.
#
# Dropped: the `--against transformers` prefill comparison at OPT-6.7B's shape did not finish within its share of a
# call twice. Its transformers side builds the random 6.7B weights on the host with JAX, converts them to a torch
# model and checks fp32 logits on the CPU before moving to the GPU: minutes of host work before the first timing.
# `python benchmarks/prefill.py --against transformers` still runs it, outside these phases.
set -u
[ $# -gt 0 ] || { sed -n '2,21p' "$0" >&2; exit 2; }
OUT=${OUT:-/tmp/specjax_gpu}
LOGS=$OUT/logs
RESULTS=${RESULTS:-results/gpu}
STORES=${STORES:-/tmp/specjax_stores}
mkdir -p "$LOGS" "$RESULTS" "$STORES"
export PYTHONUNBUFFERED=1
# Every system of an evaluation compiles its programs afresh (the runner drops them between systems): JAX's
# persistent cache turns all but the first compile of each program into a read (a tiny evaluation of 3 systems on 2
# cores: 27 s, then 10 s with the cache filled). Compiles stay out of every timed request either way.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$OUT/jax-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
PY=${PYTHON:-python3}
TINY=${TINY:-}
DEADLINE=${DEADLINE:-}  # seconds from the start for the whole session: a device call's limit less a margin

if [ -n "$TINY" ]; then
  QWEN=tiny-gqa; OPT=tiny-llama; DTYPE=float32; LIMIT=2; LONG_LIMIT=1
  P4K=256; P16K=512; P30K=1024; LIMITS_FLAGS=--tiny; TRANSFER_FLAGS=--tiny; TRACE=${TRACE:-$OUT/trace}
else
  QWEN=qwen2.5-7b; OPT=/tmp/models/opt-6.7b-pos8k; DTYPE=bfloat16; LIMIT=4; LONG_LIMIT=2
  P4K=4096; P16K=16384; P30K=30000; LIMITS_FLAGS="--store $STORES"; TRANSFER_FLAGS=; TRACE=${TRACE:-.traces/smollm2-needle}
fi

step() {  # step NAME LIMIT_S COMMAND...: the limit is cut to what DEADLINE leaves; skipped under 20 s
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  if [ -n "$DEADLINE" ]; then
    local left=$((DEADLINE - SECONDS))
    [ "$left" -ge 20 ] || { echo "== $name skipped: ${left}s left of DEADLINE=${DEADLINE}s"; return; }
    [ "$limit" -le "$left" ] || limit=$left
  fi
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  echo "   rc=$? after $((SECONDS - start))s"
  tail -n "${TAIL:-12}" "$LOGS/$name.log" | cut -c1-400
  tar czf "$OUT/results.tgz" -C "$OUT" logs -C "$PWD" "$RESULTS" 2>/dev/null
}

evaluate() {  # evaluate NAME LIMIT_S MODEL PREFIX_TOKENS REQUESTS SYSTEMS [FLAGS...]: one eval, needle, O_DIRECT
  local name=$1 limit=$2 model=$3 prefix=$4 requests=$5 systems=$6
  shift 6
  local replay=()
  case $systems in *spec*|*planner*|*as_h2o*|*impress*) replay=(--replay_selections "$TRACE") ;; esac
  step "$name" "$limit" $PY -m specjax.eval --model "$model" --init random --dtype "$DTYPE" --task needle \
    --prefix_tokens "$prefix" --limit "$requests" --systems "$systems" --retention 0.25 "${replay[@]}" \
    --store "$STORES/$name" --output_dir "$RESULTS/$name" --resume "$@"
  rm -rf "${STORES:?}/$name"  # a base store per step: disk for the next one
}

step info 60 bash -c "nvidia-smi 2>/dev/null; $PY -c 'import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())'; \
  df -h . /tmp; nproc; free -g"
if [ -z "$TINY" ]; then
  step install 120 $PY -m pip install -q -e . --no-deps --no-build-isolation
  step model 30 $PY -c "
import json, pathlib
from specjax.configs.models import MODEL_SHAPES
d = pathlib.Path('$OPT'); d.mkdir(parents=True, exist_ok=True)
(d / 'config.json').write_text(json.dumps(MODEL_SHAPES['opt-6.7b'] | {'max_position_embeddings': 8192}))
print(d)"
  [ -d "$TRACE" ] || echo "!! no selection trace at $TRACE: carry it (benchmarks/record_traces.sh); replayed steps will fail"
else
  # what record_traces.sh does with smollm2-135m, with a random tiny model: a trace for the replayed steps
  step record 200 $PY -m specjax.eval --model tiny-llama --init random --task needle --prefix_tokens 128 --limit 2 \
    --systems as_h2o_lfu,impress,spec,spec_gqa,planner --retention 0.25 --record_selections "$TRACE" \
    --store "$STORES/record" --output_dir "$RESULTS/record"
  rm -rf "${STORES:?}/record"
fi

for phase in "$@"; do
  case $phase in
  core)
    step limits 120 $PY benchmarks/machine_limits.py $LIMITS_FLAGS --output "$RESULTS/limits.json"
    step transfer 90 $PY benchmarks/host_transfer.py $TRANSFER_FLAGS --output "$RESULTS/host_transfer.json"
    # 16k first: where loading a selection can beat recomputing on a GPU. Recompute, as_full, spec and cake, the
    # planner, then spec_gqa: a step cut off at its limit keeps the systems it finished
    evaluate qwen-16k 240 $QWEN $P16K $LONG_LIMIT recompute,as_full,spec,cake,planner,spec_gqa --direct_io
    evaluate qwen-4k 260 $QWEN $P4K $LIMIT recompute,as_full,spec,cake,planner,spec_gqa --direct_io
    evaluate qwen-30k 180 $QWEN $P30K 1 recompute,as_full,spec,spec_gqa --direct_io ;;
  more)
    evaluate qwen-4k-more 200 $QWEN $P4K $LIMIT as_h2o_lfu,impress --direct_io
    evaluate qwen-16k-more 200 $QWEN $P16K $LONG_LIMIT as_h2o_lfu,impress --direct_io ;;
  precision)
    evaluate qwen-16k-bits 240 $QWEN $P16K $LONG_LIMIT recompute,as_full,as_full-kv4,spec_mixed-kv8,planner \
      --plan_bits 4 --direct_io
    evaluate qwen-4k-bits 240 $QWEN $P4K $LIMIT recompute,as_full,as_full-kv4,spec_mixed-kv8,planner --plan_bits 4 \
      --direct_io ;;
  opt)
    evaluate opt-4k 420 "$OPT" $P4K $LIMIT recompute,as_full,spec,cake,planner,as_h2o_lfu --direct_io ;;
  emulated)
    evaluate qwen-4k-5GBps 300 $QWEN $P4K $LIMIT recompute,as_full,spec,cake,planner,spec_gqa --disk_bandwidth 5GB/s ;;
  tests)
    step gpu_tests 400 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_attention.py \
      tests/test_kernels_gathered_attention.py tests/test_kernels_probe_scores.py ;;
  kernels)
    step kernels 200 $PY benchmarks/kernel_bench.py --prefix_tokens 8192,32768 --query_tokens 16,512 \
      --retention 0.25,1.0 --output_dir "$RESULTS/kernels"
    # Qwen2.5-7B's heads: a group's 7 query heads packed in one tile against a tile per query head
    step kernels-qwen 150 $PY benchmarks/kernel_bench.py --heads 28 --kv_heads 4 --selections shared,block_table \
      --prefix_tokens 4096,16384 --query_tokens 16,128 --retention 0.25 --output_dir "$RESULTS/kernels-qwen" ;;
  *)
    echo "unknown phase $phase" >&2 ;;
  esac
done
