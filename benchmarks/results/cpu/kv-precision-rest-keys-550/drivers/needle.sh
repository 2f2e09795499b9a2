#!/bin/bash
# needle, 1024-token prefixes, 32 requests, caches off: bash drivers/needle.sh OUT
# spec_mixed-kv8 (its rest's keys at 8 bits, values at 4) beside spec_mixed-kv8-restk4 (the rest's keys at 4 bits too:
# what spec_mixed-kv8 was before), as_full, as_full-kv4 and spec, in one run.
python -m specjax.eval --task needle --prefix_tokens 1024 --limit 32 \
  --systems as_full,as_full-kv4,spec_mixed-kv8,spec_mixed-kv8-restk4,spec --retention 0.25 --gpu_cache 0 \
  --cpu_cache 0 --progress=false --output_dir "$1"
