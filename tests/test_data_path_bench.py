"""benchmarks/data_path.py on a tiny random model: both rates measured over the very same bytes."""

import importlib.util
import json
import pathlib
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "data_path.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("data_path_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_engine_and_raw_rates_over_the_same_chunk_files(tmp_path):
    data_path = _load_script()
    out = tmp_path / "data_path.json"
    data_path.main(["--model", "tiny-llama", "--init", "random", "--limit", "4", "--store", str(tmp_path),
                    "--output", str(out)])
    r = json.loads(out.read_text())
    assert r["engine_MBps"] > 0 and r["raw_MBps"] > 0
    assert r["ratio_engine_over_raw"] == pytest.approx(r["engine_MBps"] / r["raw_MBps"])
    assert r["requests"] == len(r["per_request"]) == 4
    assert r["raw_bytes"] == r["engine_bytes"] > 0
    for q in r["per_request"]:
        assert q["raw_bytes"] == q["disk_bytes"] and q["raw_files"] == q["chunks_read"] > 0
    assert r["raw_first_requests"] > 0  # the two sides alternate
    assert r["compilations_timed"] == 0
    assert r["code"]["source_sha256"] and "tiny-llama" in r["command"]
    assert not list(tmp_path.glob("data-path-*"))  # the scratch stores are removed
