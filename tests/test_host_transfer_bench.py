"""benchmarks/host_transfer.py at its tiny sizes: every path it times moves the host tier's rows (it checks them),
and what a CPU has no distinct path for is reported as such, not as a rate."""

import json

import bench_scripts  # tests/bench_scripts.py


def test_host_transfer_reports_each_path_and_none_where_a_cpu_has_no_such_path(tmp_path):
    bench = bench_scripts.load("host_transfer.py", "host_transfer_bench")
    out = tmp_path / "host_transfer.json"
    result = bench.main(["--tiny", "--output", str(out)])
    assert json.loads(out.read_text()) == result and result["backend"] == "cpu"
    buffers, take = result["buffer_GBps"], result["host_tier_take"]
    assert buffers["bytes"] == 16 << 20 and buffers["pageable"] > 0
    assert buffers["dma_mapped"] is None and buffers["pinned_host"] is None  # a CPU device reads host memory
    assert (take["tokens"], take["rows"]) == (1024, 256) and take["bytes"] == 256 * 4 * 128 * 2  # K: 4 heads of 128
    assert take["pageable"]["GBps"] > 0 and take["pageable"]["host_copy_GBps"] > 0
    assert take["pages_pageable"]["pages_bytes"] == 1024 * 4 * 128 * 2 and take["pages_pageable"]["GBps"] > 0
    assert take["dma_mapped"] is None and take["pages_dma_mapped"] is None
