"""benchmarks/kv_precision.py on two PIQA requests of the real smollm2-135m: at full precision its cached path gives
the plain forward's log-probabilities, fewer bits move them more, and the bytes are the format's."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import specjax
from specjax.eval import tasks as tasks_lib, workload as workload_lib
from specjax.eval.observe_measure import ordered_by_prefix

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


@pytest.mark.skipif(not (DATA / "piqa").exists(), reason="needs the PIQA files of docs/data.md")
def test_full_precision_is_the_plain_forward_and_fewer_bits_move_the_answers_more(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kv_precision.py"), "--tasks", "piqa", "--limit", "2",
                    "--prefix_tokens", "256", "--bits", "8,2", "--key_group", "16", "--value_group", "32",
                    "--data_dir", str(DATA), "--out", str(tmp_path)], check=True, cwd=ROOT, timeout=600)
    out = json.loads((tmp_path / "kv_precision.json").read_text())
    assert (tmp_path / "kv_precision.md").read_text().startswith("# smollm2-135m")
    piqa = out["tasks"]["piqa"]["precisions"]
    model = specjax.load_model("smollm2-135m")
    task = tasks_lib.load_task("piqa", str(DATA))
    spec = workload_lib.WorkloadSpec(limit=2, prefix_tokens=256)
    requests = ordered_by_prefix(workload_lib.build_workload(task, model.tokenizer, spec).requests)
    for r, got in zip(requests, piqa["full"]["logprobs"]):
        want = [model.loglikelihood(list(r.prefix_ids + r.query_ids), list(c))[0] for c in r.choice_ids]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    assert piqa["full"]["mean_abs_logprob_change"] == 0.0
    assert 0.0 < piqa["8"]["mean_abs_logprob_change"] < piqa["2"]["mean_abs_logprob_change"]
    cfg, m = model.config, np.mean([len(r.prefix_ids) for r in requests])
    d = cfg.head_dim
    scales = (d / 16 + d / 32) * 2 * 2  # a token's share of its key groups' and value groups' bf16 scale and zero
    per_token = {bits: 2 * d * bits / 8 + scales for bits in (8, 2)}  # one KV head's K and V
    full = 2 * d * np.dtype(model.dtype).itemsize
    for bits, expected in per_token.items():  # up to the last partial key group's scales
        ratio = piqa[str(bits)]["bytes_per_token_per_layer"] / piqa["full"]["bytes_per_token_per_layer"]
        assert ratio == pytest.approx(expected / full, rel=0.02), (bits, m)
    # --pool: two runs' tasks side by side, pooled anew; a run of other settings is refused
    other = tmp_path / "other"
    other.mkdir()
    renamed = dict(out, tasks={"piqa_again": out["tasks"]["piqa"]})
    (other / "kv_precision.json").write_text(json.dumps(renamed))
    both = tmp_path / "both"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kv_precision.py"), "--pool", f"{tmp_path},{other}",
                    "--out", str(both)], check=True, cwd=ROOT, timeout=300)
    pooled = json.loads((both / "kv_precision.json").read_text())
    assert set(pooled["tasks"]) == {"piqa", "piqa_again"}
    for p in ("full", "8", "2"):
        assert pooled["pooled"][p]["paired_vs_full"]["n"] == 2 * len(requests)
        assert pooled["pooled"][p]["acc"] == pytest.approx(np.mean(piqa[p]["correct"]))
    (other / "kv_precision.json").write_text(json.dumps(dict(renamed, key_group=64)))
    refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kv_precision.py"), "--pool",
                              f"{tmp_path},{other}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "key_group" in refused.stderr + refused.stdout


@pytest.mark.skipif(not (DATA / "piqa").exists(), reason="needs the PIQA files of docs/data.md")
@pytest.mark.parametrize("grouping", ["rows", "store"])
def test_rows_and_store_groupings_measure_those_formats(tmp_path, grouping):
    """--grouping rows round-trips keys and values as rows that decode alone, --grouping store keys per chunk and
    channel as a store of format 3 holds them (its range's bytes shared by the chunk's rows): their bytes are those
    formats'."""
    from specjax.kernels import quant

    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kv_precision.py"), "--tasks", "piqa", "--limit", "1",
                    "--prefix_tokens", "256", "--bits", "4", "--grouping", grouping, "--value_group", "32",
                    "--data_dir", str(DATA), "--out", str(tmp_path)], check=True, cwd=ROOT, timeout=600)
    out = json.loads((tmp_path / "kv_precision.json").read_text())
    text = (tmp_path / "kv_precision.md").read_text()
    assert out["grouping"] == grouping
    assert ("per token over 32 channels, float16" in text) if grouping == "rows" else ("each 64-token chunk" in text)
    piqa = out["tasks"]["piqa"]["precisions"]
    d = specjax.load_model("smollm2-135m").config.head_dim
    ratio = piqa["4"]["bytes_per_token_per_layer"] / piqa["full"]["bytes_per_token_per_layer"]
    keys = quant.row_nbytes(d, 4, 32) if grouping == "rows" else d * 4 // 8 + quant.key_range_width(d, 64)
    assert ratio == pytest.approx((keys + quant.row_nbytes(d, 4, 32)) / (2 * d * 4))  # float32 KV on the CPU
    assert piqa["4"]["mean_abs_logprob_change"] > 0.0
