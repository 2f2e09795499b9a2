#!/usr/bin/env bash
# The first device call of 2026-11-25 (commit 3327a93 + an uncommitted README edit), run as `OUT=$OUT bash commands.sh` from
# the repository root; its output is session.log. Each step runs under its own time limit (rc 124: cut off there).
set -u
OUT=${OUT:-/tmp/o}; LOGS=$OUT/logs; mkdir -p $LOGS results/gpu
export PYTHONUNBUFFERED=1
PY=python3
step() { local name=$1 limit=$2 start=$SECONDS; shift 2; echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1; echo "   rc=$? after $((SECONDS - start))s"
  tail -n 12 "$LOGS/$name.log" | cut -c1-300; tar czf "$OUT/results.tgz" -C "$OUT" logs -C "$PWD" results/gpu 2>/dev/null; }
step info 30 bash -c "nvidia-smi --query-gpu=name,driver_version --format=csv; $PY -c 'import jax; print(jax.__version__, jax.devices())'"
step install 90 $PY -m pip install -q -e . --no-deps --no-build-isolation
step probe_gpu_tests 150 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_probe_scores.py tests/test_kernels_gathered_attention.py -k "probe or 512-block_table or block_table-512"
step spec_gqa_on_gpu 100 $PY -m pytest -q -p no:cacheprovider tests/test_spec_gqa.py
step attn_cpu_default 45 env JAX_PLATFORMS=cpu $PY -m pytest -q -p no:cacheprovider tests/test_attention.py -k plain_forward_and_engine
step attn_cpu_highest 45 env JAX_PLATFORMS=cpu JAX_DEFAULT_MATMUL_PRECISION=highest $PY -m pytest -q -p no:cacheprovider tests/test_attention.py -k plain_forward_and_engine
mkdir -p /tmp/models/opt-6.7b-pos8k
$PY -c "
import json, pathlib
from specjax.configs.models import MODEL_SHAPES
pathlib.Path('/tmp/models/opt-6.7b-pos8k/config.json').write_text(json.dumps(MODEL_SHAPES['opt-6.7b'] | {'max_position_embeddings': 8192}))"
step against_transformers 200 $PY -m specjax.bench --model /tmp/models/opt-6.7b-pos8k --init random --dtype bfloat16 --tokens 1024,4096 --repeats 3 --against transformers --torch_device cuda --peak_tflops 989 --output_dir results/gpu/prefill
