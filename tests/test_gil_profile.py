"""benchmarks/gil_profile.py on a hand-written py-spy profile: per-request milliseconds by frame, timed requests of
the request's thread apart from the other threads, the shared trunk left out."""

import gzip

import bench_scripts  # tests/bench_scripts.py


def test_milliseconds_per_request_by_frame(tmp_path, capsys):
    gil = bench_scripts.load("gil_profile.py", "gil_profile_bench")
    trunk = "main (eval/__main__.py:418);_run_all (eval/runner.py:151);Engine.run (specjax/engine/engine.py:202)"
    lines = [
        f"{trunk};take (specjax/engine/layer_io.py:356);wait (x.py:1) 30",
        f"{trunk};identify (specjax/engine/layer_io.py:379) 10",
        "main (eval/__main__.py:418);_run_all (eval/runner.py:140);warm (w.py:3) 500",  # not a timed request
        "Thread._bootstrap (threading.py:1002);_worker (thread.py:83);_hold (stores/prefetch.py:99) 20",
    ]
    raw = tmp_path / "profile.raw.gz"
    with gzip.open(raw, "wt") as f:
        f.write("\n".join(lines) + "\n")
    gil.main([str(raw), "--requests", "2", "--rate", "100"])
    out = capsys.readouterr().out
    # 40 timed samples at 100 Hz over 2 requests: 200 ms a request; take 150, identify 50; the trunk is not listed
    assert "request thread, timed requests: 40 samples, 200.0 ms per request" in out
    assert "   150.0 ms  take layer_io.py:356" in out and "    50.0 ms  identify layer_io.py:379" in out
    assert "Engine.run" not in out and "warm" not in out
    assert "other threads, whole run: 20 samples, 100.0 ms per request" in out
