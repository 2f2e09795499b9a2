#!/bin/bash
# needle, 1024-token prefixes, 32 requests, caches off: bash drivers/needle.sh OUT
# spec_mixed-kv8 and spec_mixed-kv8-restk4 (the chunks their selection touches whole at 8 bits, the others' values at
# 4 and keys at 8 or 4) beside as_full at full precision, 8 and 4 bits, and spec, in one run.
python -m specjax.eval --task needle --prefix_tokens 1024 --limit 32 \
  --systems as_full,as_full-kv8,as_full-kv4,spec_mixed-kv8,spec_mixed-kv8-restk4,spec --retention 0.25 --gpu_cache 0 \
  --cpu_cache 0 --progress=false --output_dir "$1"
python "$(dirname "$0")/agreement.py" "$1" > "$1/agreement.txt"
