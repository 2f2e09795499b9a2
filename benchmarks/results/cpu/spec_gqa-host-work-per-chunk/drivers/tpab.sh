#!/bin/bash
# alternate take-path runs: base venv (06e6dbe), main at 965d356, main at HEAD
cd /work/main; head=$(git rev-parse HEAD)
for i in 1 2 3; do
  (cd /tmp/base && . .venv/bin/activate && echo -n "base  " && python /tmp/drv/tp.py 16 2>&1 | tail -1)
  git -C /work/main checkout -q 965d356 && (. /work/main/.venv/bin/activate && echo -n "965d  " && python /tmp/drv/tp.py 16 2>&1 | tail -1)
  git -C /work/main checkout -q $head && (. /work/main/.venv/bin/activate && echo -n "batch " && python /tmp/drv/tp.py 16 2>&1 | tail -1)
done
git -C /work/main checkout -q main
