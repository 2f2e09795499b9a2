"""benchmarks/pooled_accuracy.py on a hand-written two-task run: pairing per task and pooled, bytes, per-layer
ITF pass rates (and spec_gqa's head shares) weighted by each task's requests."""

import json

import pytest

import bench_scripts  # tests/bench_scripts.py


def _row(system, request_id, right, disk_bytes, layers=0, fallbacks=0):
    gold = 1
    logprobs = [-2.0, -1.0] if right else [-1.0, -2.0]
    return {"system": system, "request_id": request_id, "gold": gold, "choice_logprobs": logprobs,
            "counters": {"disk_bytes": disk_bytes, "itf_layers": layers, "itf_fallbacks": fallbacks}}


def _task(directory, name, rows, systems):
    (directory / name).mkdir()
    (directory / name / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / name / "results.json").write_text(json.dumps({"systems": systems}))


def test_pairs_per_task_and_pooled_and_weights_layers_by_requests(tmp_path, capsys):
    pooled = bench_scripts.load("pooled_accuracy.py", "pooled_accuracy_bench")
    # task a: 2 requests; new right on both, reference on the first only; task b: 1 request, the reverse.
    _task(tmp_path, "a", [
        _row("ref", 0, True, 100), _row("new", 0, True, 10, 2, 1),
        _row("ref", 1, False, 100), _row("new", 1, True, 30, 2, 0),
    ], {"ref": {"accuracy": {"n": 2}, "layers": {"retained": [1.0, 1.0], "fallback": [0.0, 0.0]}},
        "new": {"accuracy": {"n": 2}, "layers": {"fallback": [0.5, 0.0], "jaccard": [0.2, 0.9],
                                                 "head_share": [0.6, 1.0]}}})
    _task(tmp_path, "b", [_row("ref", 0, True, 200), _row("new", 0, False, 0, 2, 2)],
          {"ref": {"accuracy": {"n": 1}}, "new": {"accuracy": {"n": 1},
                                                  "layers": {"fallback": [1.0, 1.0], "jaccard": [0.5, 0.3],
                                                             "head_share": [0.9, 0.3]}}})
    out = tmp_path / "pooled.json"
    pooled.main([str(tmp_path), "--reference", "ref", "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["a"]["new"]["paired"]["acc_diff"] == pytest.approx(0.5)
    assert r["a"]["new"]["disk_bytes_vs_reference"] == pytest.approx(40 / 200)
    assert r["a"]["new"]["itf_fallback"] == pytest.approx(1 / 4)
    assert r["b"]["new"]["paired"]["acc_diff"] == pytest.approx(-1.0)
    assert r["pooled"]["new"]["n"] == 3
    assert r["pooled"]["new"]["paired"]["acc_diff"] == pytest.approx(0.0)  # +1 on a, -1 on b
    assert r["pooled"]["new"]["disk_bytes_vs_reference"] == pytest.approx(40 / 400)
    assert r["pooled"]["ref"]["paired"]["acc_diff"] == 0.0
    # per layer: task a weighs twice task b; the reference has no ITF and is left out
    assert set(r["layers"]) == {"new"}
    assert r["layers"]["new"]["pass"] == pytest.approx([1 - (2 * 0.5 + 1.0) / 3, 1 - 1.0 / 3])
    assert r["layers"]["new"]["jaccard"] == pytest.approx([(2 * 0.2 + 0.5) / 3, (2 * 0.9 + 0.3) / 3])
    assert r["layers"]["new"]["head_share"] == pytest.approx([(2 * 0.6 + 0.9) / 3, (2 * 1.0 + 0.3) / 3])
    assert "ITF pass rate" in capsys.readouterr().out


def test_runs_of_several_retentions_pair_with_the_reference_at_their_own(tmp_path):
    pooled = bench_scripts.load("pooled_accuracy.py", "pooled_accuracy_bench")
    _task(tmp_path, "a", [
        _row("ref@r=0.1", 0, False, 10), _row("ref@r=0.5", 0, True, 50),
        _row("new@r=0.1", 0, True, 1), _row("new@r=0.5", 0, True, 5),
    ], {})
    out = tmp_path / "pooled.json"
    pooled.main([str(tmp_path), "--reference", "ref", "--json", str(out)])
    r = json.loads(out.read_text())["pooled"]
    assert r["new@r=0.1"]["paired"]["acc_diff"] == pytest.approx(1.0)
    assert r["new@r=0.5"]["paired"]["acc_diff"] == pytest.approx(0.0)
    assert r["new@r=0.1"]["disk_bytes_vs_reference"] == pytest.approx(0.1)
