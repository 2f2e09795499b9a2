"""The store's systems on a model split over two processes on localhost (2 forced CPU devices each), sharing one
store (specjax.engine.processes), against one process: the same answers, log-probabilities and selections, and each
process reads its own heads' half of the bytes.

Each process runs tests/store_processes_worker.py (a process joins the runtime before JAX starts, so not this one);
this process runs the same requests on one device and compares.
"""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

import specjax
from specjax.config import from_hf_config, save_config
from specjax.configs.models import MODEL_SHAPES
from specjax.stores import K, KVStore

import store_processes_worker as worker  # tests/ is on the path
from processes import DEVICES_PER_PROCESS, finish, free_port, needs_cpu_collectives, run_workers, start_workers

EXACT = 1e-5  # fp32: the same computation, summed over heads in another order
WORKER = pathlib.Path(__file__).with_name("store_processes_worker.py")
TIMEOUT_S = 600
SYSTEMS = ("recompute", "as_full", "as_h2o_lru", "as_h2o_lfu", "impress", "spec", "spec_mixed", "spec_gqa",
           "contiguous_kv", "cake", "planner", "cacheblend")  # every system the store serves
RACED = ("cake",)  # what it reads is where its device and loader meet: the processes agree on it, one process alone


def _model(folder: pathlib.Path) -> str:
    """tiny-llama with 8 query heads over 4 KV heads (one KV head per device), RoPE for CacheBlend."""
    path = folder / "tiny-llama-kv4"
    path.mkdir()
    cfg = dataclasses.replace(from_hf_config(MODEL_SHAPES["tiny-llama"]), num_heads=8, num_kv_heads=4, head_dim=8,
                              bos_token_id=1)
    save_config(cfg, path / "config.json")
    return str(path)


def _check(reports: list[dict], out: pathlib.Path, model_path: str, store: pathlib.Path, systems) -> None:
    """Each process's answers equal one process's; each read its own heads' half of what one process reads."""
    model = specjax.load_model(model_path, init="random", seed=1)
    for name in systems:
        one, counts = worker.run_system(model, name, worker.location_of(str(store), name))
        for process, report in enumerate(reports):
            assert report["process_index"] == process
            got = np.load(out / f"{name}.process{process}.npz")
            assert sorted(got.files) == sorted(one), (name, process)
            for key, want in one.items():
                if key.startswith("selection"):  # the same tokens chosen, on every layer
                    np.testing.assert_array_equal(got[key], want, err_msg=f"{name} {process} {key}")
                else:
                    diff = float(np.abs(got[key] - want).max())
                    assert diff <= EXACT, (name, process, key, diff)
            mine = report["systems"][name]
            assert mine["reused"] == counts["reused"], (name, process)
            if name in RACED:  # every process the same meeting point (what each read is its own race's)
                assert mine["split"] == reports[0]["systems"][name]["split"], (name, mine["split"])
                assert any(s and s["loaded_chunks"] for s in mine["split"]), mine["split"]  # chunks of both
            else:  # its heads: half of the bytes (K and V by its own devices, the probe heads' keys split by process)
                assert [2 * n for n in mine["disk_bytes"]] == counts["disk_bytes"], (name, process, mine, counts)
            for by_device, n in zip(mine["by_device"], mine["disk_bytes"]):
                own = by_device[process * DEVICES_PER_PROCESS:(process + 1) * DEVICES_PER_PROCESS]
                assert not by_device or sum(own) == sum(by_device) <= n, (name, process, by_device)
        assert any(counts["reused"]) == (name != "recompute"), name
        if name in ("as_full", "spec"):  # read from disk (CacheBlend's chunks are in its caches from storing them)
            assert all(counts["disk_bytes"][i] for i in (0, 3)), name


@pytest.mark.slow
@needs_cpu_collectives
def test_two_processes_share_one_store(tmp_path):
    """Every system over one shared store folder; as_full and spec again through a kvstore URL."""
    model = _model(tmp_path)
    out, store = tmp_path / "out", tmp_path / "store"
    out.mkdir()
    reports = run_workers(WORKER, out, [model, str(store), *SYSTEMS], TIMEOUT_S)
    for report in reports:
        assert report["errors"] == {}
    _check(reports, out, model, tmp_path / "one", SYSTEMS)
    # the same store through a TensorStore kvstore URL (an OCDBT database on a file:// path): the same results
    url_out = tmp_path / "url_out"
    url_out.mkdir()
    url = run_workers(WORKER, url_out, [model, f"file://{tmp_path / 'url'}|ocdbt", "as_full", "spec"], TIMEOUT_S)
    assert (tmp_path / "url" / "spec" / "manifest.ocdbt").is_file()
    for name in ("as_full", "spec"):
        for process in range(len(reports)):
            a, b = np.load(out / f"{name}.process{process}.npz"), np.load(url_out / f"{name}.process{process}.npz")
            assert sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files), name
            assert url[process]["systems"][name] == reports[process]["systems"][name], name


@pytest.mark.slow
@needs_cpu_collectives
def test_a_chunk_damaged_in_one_process_heads(tmp_path):
    """A stored chunk damaged in process 1's KV heads only: process 1 alone finds it, every process recomputes the
    request (as one process does), process 0 drops the prefix and every process stores it anew, the next request
    reuses it whole, and the store passes fsck."""
    model = _model(tmp_path)
    out, store = tmp_path / "out", tmp_path / "store"
    out.mkdir()
    names = [worker.DAMAGED + name for name in ("as_full", "spec")]
    reports = run_workers(WORKER, out, [model, str(store), *names], TIMEOUT_S)
    one = specjax.load_model(model, init="random", seed=1)
    for name in names:
        want, counts = worker.run_damaged(one, name.removeprefix(worker.DAMAGED), str(tmp_path / "one" / name))
        assert counts["recomputed"] == [True, False] and counts["reused"] == [0, worker.PREFIX_TOKENS[0]], counts
        for process, report in enumerate(reports):
            assert report["errors"] == {}
            mine = report["systems"][name]
            assert (mine["recomputed"], mine["reused"], mine["repaired"]) == (counts["recomputed"], counts["reused"],
                                                                              1), (name, process, mine)
            got = np.load(out / f"{name}.process{process}.npz")
            for key, array in want.items():
                assert float(np.abs(got[key] - array).max()) <= EXACT, (name, process, key)
        found = [report["systems"][name]["bad_chunks"][0] for report in reports]
        assert found[0] == 0 and found[1] >= 1, found  # in process 1's heads: process 0 read none of it
        fsck = subprocess.run([sys.executable, "-m", "specjax.stores.fsck", str(store / name)], capture_output=True,
                              text=True)
        assert fsck.returncode == 0, fsck.stdout + fsck.stderr


@pytest.mark.slow
@needs_cpu_collectives
@pytest.mark.parametrize("victim", [1, 0], ids=["process1", "process0-the-coordinator"])
def test_a_process_killed_mid_run(tmp_path, victim):
    """A process killed once the first store is made: the other stops within 60 s with one line naming what happened
    (its watch over the others, the step across processes that failed, or the runtime's coordination service gone
    with process 0); every store passes fsck, and a following run on them serves what a clean run serves."""
    model = _model(tmp_path)
    out, store = tmp_path / "out", tmp_path / "store"
    out.mkdir()
    workers = start_workers(WORKER, out, [model, str(store), "as_full", "spec", "contiguous_kv"])
    survivor, killed = workers[1 - victim], workers[victim]
    try:
        deadline = time.monotonic() + 300
        while not (store / "as_full").is_dir() and time.monotonic() < deadline and survivor.poll() is None:
            time.sleep(0.2)
        assert (store / "as_full").is_dir(), survivor.communicate(timeout=60)[1][-3000:]
        killed.kill()
        at = time.monotonic()
        _, stderr = survivor.communicate(timeout=90)
        took = time.monotonic() - at
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
            w.communicate()
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("[Gloo]")]
    assert survivor.returncode not in (0, None) and took < 60, (survivor.returncode, took, lines[-5:])
    said = [line for line in lines if "stops" in line or "Check failure" in line or line.startswith(("F1", "E1"))]
    assert len(said) == 1 and said[0] == lines[-1], lines[-8:]
    assert lines[-1].startswith(f"specjax: process {1 - victim} of 2 stops: "), lines[-5:]
    for folder in sorted(store.iterdir()):
        fsck = subprocess.run([sys.executable, "-m", "specjax.stores.fsck", str(folder)], capture_output=True,
                              text=True)
        assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    # a following run on the same stores serves what a clean run serves: every request whose prefix is stored as in
    # the clean run (all but one: the second prefix's first request reuses it where the killed run had committed it)
    again = tmp_path / "again"
    again.mkdir()
    reports = run_workers(WORKER, again, [model, str(store), "as_full", "spec"], TIMEOUT_S)
    one = specjax.load_model(model, init="random", seed=1)
    for name in ("as_full", "spec"):
        clean, counts = worker.run_system(one, name, worker.location_of(str(tmp_path / "clean"), name))
        reused = reports[0]["systems"][name]["reused"]
        alike = [i for i, n in enumerate(counts["reused"]) if reused[i] == n]
        assert len(alike) >= len(reused) - 1, (name, reused, counts["reused"])
        got = np.load(again / f"{name}.process0.npz")
        for i in alike:
            for key in (f"first{i}", f"continuations{i}"):
                assert float(np.abs(got[key] - clean[key]).max()) <= EXACT, (name, key)


EVAL_FLAGS = ["--init", "random", "--task", "piqa", "--limit", "4", "--prefix_tokens", "512", "--systems",
              "as_full,spec", "--retention", "0.25", "--tensor_parallel", "4", "--noprogress"]


@pytest.mark.slow
@needs_cpu_collectives
def test_the_evaluation_over_two_processes(tmp_path, shared_data_dir):
    """`python -m specjax.eval` started once per process (--num_processes 2, --tensor_parallel 4 over both) against
    one process with 4 devices: the same answers and log-probabilities, process 0 writes results.json, and each
    process's disk bytes (its `processes` entry) are half of one process's. Then again over the same store with a
    byte of its base flipped in process 1's heads: the requests that meet it are recomputed, the base is repaired,
    and as_full's answers stand."""
    model = _model(tmp_path)
    flags_ = [*EVAL_FLAGS, "--model", model, "--data_dir", str(shared_data_dir)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    one = subprocess.run([sys.executable, "-m", "specjax.eval", *flags_, "--store", str(tmp_path / "store1"),
                          "--output_dir", str(tmp_path / "one")], capture_output=True, text=True, timeout=600,
                         env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=4"))
    assert one.returncode == 0, one.stderr[-3000:]
    done = _eval_two(flags_, tmp_path / "store2", tmp_path / "two")
    assert "wrote" in done[0][0] and "wrote" not in done[1][0]  # process 0 writes the results, and says so
    a = [json.loads(line) for line in (tmp_path / "one" / "requests.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (tmp_path / "two" / "requests.jsonl").read_text().splitlines()]
    assert [(x["system"], x["request_id"]) for x in a] == [(y["system"], y["request_id"]) for y in b]
    for x, y in zip(a, b):
        assert np.abs(np.subtract(x["choice_logprobs"], y["choice_logprobs"])).max() <= 1e-4, (x, y)
    results_one = json.loads((tmp_path / "one" / "results.json").read_text())
    results_two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert [p["process"] for p in results_two["processes"]] == [0, 1]
    for key, system in results_one["systems"].items():
        each = [p["io"][key]["disk_bytes"] for p in results_two["processes"]]
        assert system["io"]["disk_bytes"] > 0 and each == [system["io"]["disk_bytes"] / 2] * 2, (key, each)
    (base,) = [d for d in (tmp_path / "store2").glob("base-*") if d.is_dir()]
    with KVStore.open(base, None) as store:
        key, offset = store.extent_of(1, K, sorted(store.stored_chunk_ids())[0])
        at = offset + store.layout.chunk_nbytes(K) * 7 // 8  # the last KV head's: process 1's
    data = bytearray((base / key).read_bytes())
    data[at] ^= 0xFF
    (base / key).write_bytes(bytes(data))
    _eval_two(flags_, tmp_path / "store2", tmp_path / "three")
    results = json.loads((tmp_path / "three" / "results.json").read_text())
    # as_full's run meets it (its copy of the base shares the damaged file; in its warm-up, whose reads are not the
    # timed requests') and repairs its copy, then the base; spec's run then finds the base whole
    assert results["systems"]["as_full"]["repair"]["prefixes"] >= 1, results["systems"]["as_full"]
    assert results["stores"][base.name]["prefixes_repaired"] >= 1, results["stores"]
    c = [json.loads(line) for line in (tmp_path / "three" / "requests.jsonl").read_text().splitlines()]
    for x, y in zip(b, c):
        if x["system"] == "as_full":
            assert np.abs(np.subtract(x["choice_logprobs"], y["choice_logprobs"])).max() <= 1e-4, (x, y)
    fsck = subprocess.run([sys.executable, "-m", "specjax.stores.fsck", str(base)], capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr


def _eval_two(flags_: list[str], store: pathlib.Path, out: pathlib.Path) -> list[tuple[str, str]]:
    """`python -m specjax.eval FLAGS --store STORE --output_dir OUT` over 2 processes x 2 CPU devices (each one's
    stdout and stderr)."""
    address = f"localhost:{free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}")
    return finish([subprocess.Popen([sys.executable, "-m", "specjax.eval", *flags_, "--store", str(store),
                                     "--output_dir", str(out), "--num_processes", "2", "--process_id", str(i),
                                     "--coordinator", address], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env) for i in range(2)], 600)
