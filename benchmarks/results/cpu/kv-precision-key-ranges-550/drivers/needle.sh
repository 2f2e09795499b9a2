#!/bin/bash
# needle, 1024-token prefixes, 32 requests, caches off: bash drivers/needle.sh OUT
python -m specjax.eval --task needle --prefix_tokens 1024 --limit 32 \
  --systems as_full,as_full-kv4,spec,spec_mixed-kv8,spec_mixed-kv8-rest2 --retention 0.25 --gpu_cache 0 \
  --cpu_cache 0 --progress=false --output_dir "$1"
