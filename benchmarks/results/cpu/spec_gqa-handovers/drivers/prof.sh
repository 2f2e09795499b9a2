for s in spec_gqa as_h2o_lfu; do
py-spy record --idle --nonblocking --format raw --rate 200 -o /tmp/s1/wall-$s.txt -- python -m specjax.eval --task piqa --data_dir ../shared/data --limit 24 --prefix_tokens 1024 --systems $s --retention 0.25 --progress=false --output_dir /tmp/s1/wall-$s > /tmp/s1/wall-$s.log 2>&1
done
echo done > /tmp/s1/prof.done
