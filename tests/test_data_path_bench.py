"""benchmarks/data_path.py on a tiny random model: the disk's rate and each system's TTFT, bytes and host time."""

import json
import os

import pytest

import bench_scripts  # tests/bench_scripts.py


def test_systems_are_measured_against_the_disks_own_rate_in_the_same_run(tmp_path):
    data_path = bench_scripts.load("data_path.py", "data_path_bench")
    out = tmp_path / "data_path.json"
    data_path.main(["--model", "tiny-llama", "--dtype", "float32", "--prefix_tokens", "256", "--limit", "3",
                    "--systems", "as_full,spec", "--disk_mb", "8", "--read_mb", "1", "--store", str(tmp_path),
                    "--output", str(out)])
    r = json.loads(out.read_text())
    disk = r["disk"]
    seconds = [x for reader in ("preadv", "tensorstore") for x in disk[reader]["second_GBps"]]
    assert disk["disk_GBps"] == max(seconds) > 0 and len(seconds) == 4
    assert disk["preadv"]["cold_GBps"] > 0 and disk["tensorstore"]["cold_GBps"] > 0
    assert set(r["systems"]) == {"as_full", "spec"}
    # the device's own work of loading everything: more than nothing, less than a request that also reads
    assert 0 < r["device_floor_ms"] < r["systems"]["as_full"]["ttft_ms"]
    for s in r["systems"].values():
        assert s["disk_bytes"] > 0 and len(s["ttft_ms_per_request"]) == 3
        assert s["bytes_ms"] == pytest.approx(s["disk_bytes"] / (disk["disk_GBps"] * 1e9) * 1e3)
        assert s["ttft_over_bytes_ms"] == pytest.approx(s["ttft_ms"] / s["bytes_ms"])
        assert s["ttft_over_bound_ms"] == pytest.approx(s["ttft_ms"] / max(s["bytes_ms"], r["device_floor_ms"]))
        assert s["ttft_over_bytes_plus_device_ms"] == pytest.approx(
            s["ttft_ms"] / (s["bytes_ms"] + r["device_floor_ms"] + s["device_identify_ms"]))
        assert 0 <= s["host_exposed_ms"] <= max(s["ttft_ms_per_request"])
        assert 0 < s["cpu_ms"] <= max(s["ttft_ms_per_request"]) * len(os.sched_getaffinity(0)) + 1
        assert s["compilations_timed"] == 0
    # as_full reads each layer's K and V as one extent: 2 reads per layer (tiny-llama: 2 layers, one segment)
    assert r["systems"]["as_full"]["reads"] == 2 * 2
    assert r["code"]["source_sha256"] and "tiny-llama" in r["command"] and r["timing_shape"] is None
    assert not list(tmp_path.glob("data-path-*"))  # the scratch stores and files are removed
