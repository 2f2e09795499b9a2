"""benchmarks/take_path.py on a tiny KV geometry: what it reads per request, and that it leaves nothing behind."""

import json

import bench_scripts  # tests/bench_scripts.py


def test_take_path_reads_each_layers_keys_and_values_as_one_read_per_chunk_size(tmp_path):
    take_path = bench_scripts.load("take_path.py", "take_path_bench")
    out = tmp_path / "take_path.json"
    rows = take_path.main(["--model", "tiny-llama", "--prefix_tokens", "128", "--chunk_tokens", "16,64",
                           "--value_share", "1.0", "--requests", "2", "--dir", str(tmp_path), "--output", str(out)])
    layers, kv_heads, head_dim = take_path.geometry("tiny-llama")
    assert (layers, kv_heads, head_dim) == (2, 2, 16)
    assert [r["chunk_tokens"] for r in rows] == [16, 64]
    for r in rows:
        # caches off: every layer's K and V (all values at share 1.0) each one read of its whole extent, bf16
        assert r["disk_bytes"] == layers * 2 * kv_heads * 128 * head_dim * 2
        assert r["read_requests"] == layers * 2
        assert r["chunks_read"] == r["misses"] == layers * 2 * 128 // r["chunk_tokens"]
        assert r["ms_per_request"] > 0 and 0 < r["thread_cpu_ms_per_request"] <= r["cpu_ms_per_request"]
    assert json.loads(out.read_text())["rows"] == rows
    assert not list(tmp_path.glob("take_path-*"))  # the scratch stores are removed
