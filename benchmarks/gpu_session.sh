#!/usr/bin/env bash
# The GPU runs, as phases, any of them in one device call:
#   tests    the @pytest.mark.gpu tests (Pallas kernels compiled through Triton, cuDNN attention)
#   prefill  against (prefill vs transformers on the same GPU, bf16, SDPA) and engine (the engine's recompute vs
#            the plain forward)
#   kernels  the kernel benchmark (Pallas vs the jnp reference vs dense attention)
#   data     the data-path benchmark and the as_full / impress / spec evaluation on O_DIRECT reads
#   gqa      as_h2o_lfu / spec / spec_gqa on a grouped-query shape (Qwen2.5-7B, random weights), O_DIRECT reads
#
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh against engine
#
# A device call runs at most 10 minutes: split the phases, e.g. `against engine`, then `data`, then `tests kernels`.
# Every step runs under its own time limit and logs to $OUT/logs; results land in results/gpu/ and, with the
# logs, in $OUT/results.tgz after every step (so a run cut short still returns what it finished).
# The model is OPT-6.7B's shape with random weights and its learned position table extended from 2048 to 8192
# rows (random too), so prompts of 4k and 8k tokens fit; compute per token is OPT-6.7B's.
set -u
[ $# -gt 0 ] || { echo "usage: gpu_session.sh tests|prefill|against|engine|kernels|data|gqa ..." >&2; exit 2; }
OUT=${OUT:-/tmp/specjax_gpu}
LOGS=$OUT/logs
RESULTS=results/gpu
mkdir -p "$LOGS" "$RESULTS"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
MODEL=/tmp/models/opt-6.7b-pos8k

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  echo "   rc=$? after $((SECONDS - start))s"
  tail -n "${TAIL:-15}" "$LOGS/$name.log" | cut -c1-400
  tar czf "$OUT/results.tgz" -C "$OUT" logs -C "$PWD" "$RESULTS" 2>/dev/null
}

step info 60 bash -c "nvidia-smi; $PY -c 'import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())'; \
  df -h . /tmp; lsblk -o NAME,SIZE,ROTA,MODEL,MOUNTPOINT; nproc; free -g"
step install 120 $PY -m pip install -q -e . --no-deps --no-build-isolation
step model 30 $PY -c "
import json, pathlib
from specjax.configs.models import MODEL_SHAPES
d = pathlib.Path('$MODEL'); d.mkdir(parents=True, exist_ok=True)
(d / 'config.json').write_text(json.dumps(MODEL_SHAPES['opt-6.7b'] | {'max_position_embeddings': 8192}))
print(d)"

for phase in "$@"; do
  case $phase in
  tests)
    step gpu_tests 400 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_attention.py \
      tests/test_kernels_gathered_attention.py tests/test_kernels_probe_scores.py ;;
  prefill|against)
    step against_transformers 420 $PY -m specjax.bench --model "$MODEL" --init random --dtype bfloat16 \
      --tokens 1024,4096,8192 --repeats 3 --against transformers --torch_device cuda --peak_tflops 989 \
      --output_dir "$RESULTS/prefill" ;;&
  prefill|engine)
    step engine_recompute 120 $PY -m specjax.bench --model "$MODEL" --init random --dtype bfloat16 --tokens 1024,4096 \
      --repeats 5 --engine --output_dir "$RESULTS/prefill" ;;
  kernels)
    step kernels 200 $PY -m specjax.kernels.bench --prefix_tokens 8192,32768 --query_tokens 16,512 \
      --retention 0.25,1.0 --output_dir "$RESULTS/kernels" ;;
  data)
    step data_path 200 $PY benchmarks/data_path.py --model "$MODEL" --init random --dtype bfloat16 --task needle \
      --prefix_tokens 4096 --limit 8 --store /tmp/store_dp --output "$RESULTS/data_path-opt-6.7b-pos8k-needle8-4k.json"
    step eval 360 $PY -m specjax.eval --model "$MODEL" --init random --dtype bfloat16 --task needle \
      --prefix_tokens 4096 --limit 8 --systems as_full,impress,spec --retention 0.25 --direct_io --progress=false \
      --store /tmp/store_eval --output_dir "$RESULTS/eval-opt-6.7b-pos8k-needle8-4k-odirect" ;;
  gqa)
    # issue 22 on a grouped-query shape (Qwen2.5-7B: 28 query heads on 4 KV heads, random weights): TTFT and bytes
    step gqa_eval 420 $PY -m specjax.eval --model qwen2.5-7b --init random --dtype bfloat16 --task needle \
      --prefix_tokens 4096 --limit 8 --systems as_h2o_lfu,spec,spec_gqa --retention 0.25 --direct_io --progress=false \
      --store /tmp/store_gqa --output_dir "$RESULTS/eval-qwen2.5-7b-needle8-4k-odirect-gqa" ;;
  prefill|against|engine) ;;
  *)
    echo "unknown phase $phase" >&2 ;;
  esac
done
