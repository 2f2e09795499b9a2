"""benchmarks/kernel_bench.py runs end to end on tiny shapes and labels CPU numbers as such."""

import json

import bench_scripts  # tests/bench_scripts.py


def test_quick_bench_writes_labelled_results(tmp_path):
    bench = bench_scripts.load("kernel_bench.py", "kernels_bench")
    rows = bench.main(["--quick", "--retention", "0.5", "--selections", "shared,block_table",
                       "--reps", "1", "--output_dir", str(tmp_path)])
    assert {r["kernel"] for r in rows} == {"probe_scores", "gathered_attention", "low_bit_attention 4-bit"}
    assert all(r["pallas_ms"] > 0 and r["dense_full_ms"] > 0 for r in rows)
    # QUICK's 4 heads over 2 KV heads: the shared selections also time a tile per query head, side by side
    attention = [r for r in rows if r["kernel"] == "gathered_attention"]
    assert attention and all(r["pallas_per_head_tiles_ms"] > 0 for r in attention)
    [json_path] = tmp_path.glob("kernels_*.json")
    [md_path] = tmp_path.glob("kernels_*.md")
    payload = json.loads(json_path.read_text())
    if payload["device"]["platform"] != "gpu":
        assert "CPU smoke run" in md_path.read_text()
    assert len(payload["rows"]) == len(rows)
    assert [r for r in rows if r["kernel"].startswith("low_bit")][0]["selection"] == "shared"
