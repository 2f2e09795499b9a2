#!/bin/bash
# The side-by-side driver of odirect-eval-*/ and realdisk-eval-*/: PAIRS pairs of runs, base then new, each alone on
# the machine, into OUT/base-N and OUT/new-N. BASE and MAIN are the two trees, each with its own .venv (here: a
# worktree at 688907b; the main tree at 54c0fb0 for *-per-run, at cc26c44 for *-slot).
#   BASE=../wt-base MAIN=. OUT=odirect-eval-slot PAIRS=2 bash alternate.sh odirect   # O_DIRECT, timing shape, caches off
#   BASE=../wt-base MAIN=. OUT=realdisk-eval-slot PAIRS=1 bash alternate.sh realdisk # real disk, PIQA, default caches
set -u
OUT=$(realpath -m "$OUT")
mkdir -p "$OUT"
case $1 in
  odirect) args=(--model timing-qwen2.5-7b --init random --task needle --limit 3 --prefix_tokens 4096
                 --gpu_cache 0 --cpu_cache 0 --direct_io);;
  realdisk) args=(--task piqa --data_dir ../shared/data --limit 40 --prefix_tokens 1024);;
  *) echo "usage: BASE=TREE MAIN=TREE OUT=DIR PAIRS=N bash alternate.sh odirect|realdisk" >&2; exit 2;;
esac
for i in $(seq "$PAIRS"); do
  for t in base new; do
    if [ $t = base ]; then dir=$BASE; else dir=$MAIN; fi
    (cd "$dir" && . .venv/bin/activate &&
     python -m specjax.eval "${args[@]}" --systems as_h2o_lfu,spec_gqa --retention 0.25 --progress=false \
       --output_dir "$OUT/$t-$i" > "$OUT/$t-$i.log" 2>&1)
  done
done
