#!/bin/bash
# usage: abba.sh OUTDIR SYSTEMS A B: benchmarks/data_path.py runs in the order A B B A A B B A, each alone
out=$1; systems=$2; a=$3; b=$4
mkdir -p $out
i=0
for t in $a $b $b $a $a $b $b $a; do
  i=$((i + 1))
  name=$(basename $t)
  cd $t && . .venv/bin/activate && python benchmarks/data_path.py --model timing-qwen2.5-7b --limit 4 --systems $systems --output $out/$name-$i.json > $out/$name-$i.log 2>&1
  deactivate
done
echo finished > $out/done
