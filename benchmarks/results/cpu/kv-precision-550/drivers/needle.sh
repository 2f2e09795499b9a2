#!/bin/bash
# needle, 1024-token prefixes, 32 requests, caches off, spec_mixed-kv8 with its probe keys at 8 bits:
#   bash drivers/needle.sh OUT
python -m specjax.eval --task needle --prefix_tokens 1024 --limit 32 --systems as_full,spec,spec_mixed-kv8 \
  --retention 0.25 --gpu_cache 0 --cpu_cache 0 --progress=false --output_dir "$1"
