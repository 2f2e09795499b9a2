"""`python -m specjax.stores.bench --compare_layouts` on a tiny layer: both layouts hold the written bytes, the
chunk files preadv reads are those bytes, and the JSON has one row per dtype x layout x run length."""

import itertools
import json

import numpy as np
import pytest

from specjax.stores import bench
from specjax.stores.kvarray import Layout

N_CHUNKS = 32


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layouts_read_back_the_written_layer(tmp_path, dtype):
    lay = Layout(1, 2, 16, 0, 64, dtype)
    data = bench.random_layer(lay, N_CHUNKS)
    starts = bench.pick_runs(np.random.default_rng(0), N_CHUNKS, 4, 6)
    for shard in (0, 4, 16):
        directory = str(tmp_path / bench.layout_name(shard))
        arr = bench.open_layout(directory, lay, shard, create=True)
        bench._run_view(arr, lay, 0, N_CHUNKS).write(data).result()
        for cache in (0, 2**20):
            arr = bench.open_layout(directory, lay, shard, cache)
            if cache and shard:
                bench.warm_shard_index(arr, lay, starts, 4, shard, N_CHUNKS)
            got = bench.read_runs(arr, lay, starts, 4)
            for s, a in zip(starts, got):
                np.testing.assert_array_equal(a, data[:, s * 64:(s + 4) * 64])
    for c in range(N_CHUNKS):  # the files preadv reads hold exactly the chunk's bytes
        with open(bench.chunk_path(str(tmp_path / "chunks"), c), "rb") as f:
            assert f.read() == data[:, c * 64:(c + 1) * 64].tobytes()


def test_pick_runs_do_not_overlap():
    starts = bench.pick_runs(np.random.default_rng(3), 100, 4, 10)
    chunks = [s + j for s in starts for j in range(4)]
    assert len(starts) == 10 and len(set(chunks)) == 40 and max(chunks) < 100


def test_compare_layouts_json(tmp_path):
    out = tmp_path / "layouts.json"
    bench.main(["--compare_layouts", "--dir", str(tmp_path / "store"), "--tokens", str(64 * N_CHUNKS),
                "--kv_heads", "2", "--head_dim", "16", "--runs", "1,4", "--shard_chunks", "4,16",
                "--repeats", "2", "--index_cache_MiB", "1", "--output", str(out)])
    results = json.loads(out.read_text())
    got = {(r["dtype"], r["layout"], r["index_cache_MiB"], r["run_chunks"]) for r in results["reads"]}
    layouts = [("chunks", 0), ("shard4", 0), ("shard4", 1), ("shard16", 0), ("shard16", 1), ("preadv", 0)]
    assert got == {(d, name, cache, run) for d, (name, cache), run
                   in itertools.product(["float32", "bfloat16"], layouts, [1, 4])}
    assert len(results["reads"]) == len(got)
    for r in results["reads"]:
        assert r["bytes"] == r["reads"] * r["run_chunks"] * 2 * 64 * 16 * (4 if r["dtype"] == "float32" else 2)
        assert r["MBps"] > 0 and r["reads_per_s"] > 0 and r["file_reads"] > 0
    costs = {(c["dtype"], c["layout"]): c for c in results["store_costs"]}
    assert set(costs) == {(d, n) for d in ["float32", "bfloat16"] for n in ["chunks", "shard4", "shard16"]}
    assert costs["float32", "chunks"]["files"] == N_CHUNKS and costs["float32", "shard4"]["files"] == N_CHUNKS // 4
