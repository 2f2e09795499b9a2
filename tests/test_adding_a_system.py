"""A new system in one file (`examples/recent_window.py`, as docs/development.md's "Adding a system" walks through):
registering it makes a policy and a system every tool names, it reads only its window's chunks, it equals recompute at
retention 1.0, and `python -m specjax.eval --plugins` runs it beside the engine's systems."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import specjax
from specjax.engine import identify, systems
from specjax.errors import SpecjaxError
from specjax.eval import registry
from specjax.eval.errors import EvalError

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "recent_window.py"


@pytest.fixture(scope="module", autouse=True)
def plugin():
    """The example loaded for this module's tests, its registrations taken back after them (other tests see the
    engine's systems only)."""
    (name,) = registry.load_plugins(str(EXAMPLE))
    yield sys.modules[name]
    identify.POLICIES.pop("recent", None)
    systems.SYSTEMS.pop("recent_window", None)
    sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def model():
    return specjax.load_model("tiny-llama", init="random", seed=3)


def _request(model, m=100, n=6):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.config.vocab_size, m + n).tolist()
    return specjax.Request(tokens[:m], tokens[m:], [tokens[m:m + 2]])


def test_the_file_registers_a_policy_and_a_system_once(plugin):
    assert identify.POLICIES["recent"].__name__ == "RecentWindow"
    assert systems.SYSTEMS["recent_window"].identify == "recent" and systems.SYSTEMS["recent_window"].prunes
    assert registry.load_plugins(str(EXAMPLE)) == [plugin.__name__]  # loading it again registers nothing twice
    with pytest.raises(SpecjaxError, match="taken"):
        identify.register("recent")(identify.POLICIES["recent"])
    with pytest.raises(SpecjaxError, match="registered already"):
        systems.register(systems.System("recent_window", identify="recent"))
    with pytest.raises(SpecjaxError, match="unknown identify 'nowhere'"):
        systems.System("broken", identify="nowhere")
    with pytest.raises(EvalError, match="no file"):
        registry.load_plugins("examples/not_there.py")


def test_it_reads_its_window_only_and_equals_recompute_when_it_keeps_everything(model, plugin, tmp_path):
    request = _request(model)
    m, c = len(request.prefix), 16
    recent = systems.SYSTEMS["recent_window"]
    window = plugin.window
    store = specjax.open_store(model, tmp_path / "kv", chunk_tokens=c)
    try:
        kept = {}
        for retention in (0.25, 1.0):
            engine = specjax.prefill_engine(model, recent.name, store, retention=retention)
            engine.warm(request.prefix)
            kept[retention] = engine.run(request)
        recomputed = specjax.prefill_engine(model, "recompute").run(request)
        layout = store.layout
    finally:
        store.close()
    k = int(np.ceil(0.25 * m))
    chunks = np.unique(window(m, k) // c)  # the chunks its window touches, read as whole chunks
    per_chunk = 2 * layout.kv_heads * c * layout.head_dim * np.dtype(layout.dtype).itemsize  # K and V
    assert kept[0.25].io["disk_bytes"] == model.config.num_layers * len(chunks) * per_chunk
    assert kept[1.0].io["disk_bytes"] == model.config.num_layers * -(-m // c) * per_chunk
    np.testing.assert_allclose(kept[1.0].continuation_logprobs[0][0], recomputed.continuation_logprobs[0][0],
                               atol=1e-5)
    assert abs(kept[0.25].continuation_logprobs[0][0] - recomputed.continuation_logprobs[0][0]) > 1e-6


def test_the_evaluation_runs_it_beside_the_engines_systems(tmp_path):
    """In a process of its own, as a user runs it: --plugins is imported before --systems is checked."""
    command = [sys.executable, "-m", "specjax.eval", "--model=tiny-llama", "--init=random", "--task=needle",
               "--prefix_tokens=256", "--limit=2", "--systems=as_full,recent_window", f"--plugins={EXAMPLE}",
               "--retention=0.25", "--noprogress", "--chunk_tokens=16", "--gpu_cache=0", "--cpu_cache=0",
               f"--output_dir={tmp_path / 'out'}", f"--store={tmp_path / 'store'}"]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    runs = results["systems"]
    assert set(runs) == {"as_full", "recent_window"}
    window_run = runs["recent_window"]
    assert window_run["accuracy"]["n"] == runs["as_full"]["accuracy"]["n"] == 2
    assert 0 < window_run["io"]["disk_bytes"] < 0.5 * runs["as_full"]["io"]["disk_bytes"]
    assert results["config"]["plugins"] == str(EXAMPLE)
    unknown = subprocess.run(command[:8] + ["--systems=recent_window"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=600)
    assert unknown.returncode != 0 and "unknown system 'recent_window'" in unknown.stderr  # without --plugins
