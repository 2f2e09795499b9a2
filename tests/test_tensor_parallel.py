"""Tensor parallelism (specjax.sharding) on 8 forced CPU devices against one device.

JAX fixes its device count when it starts, so the multi-device runs happen in a subprocess (tests/tp_worker.py)
with XLA_FLAGS=--xla_force_host_platform_device_count=8; the single-device mesh-free checks run here.
"""

import json
import os
import pathlib
import subprocess
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import sharding as sh
from specjax.errors import SpecjaxError

EXACT = 1e-5  # fp32: the same computation, summed over heads in another order
WORKER = pathlib.Path(__file__).with_name("tp_worker.py")


def _worker(*cases: str, devices: int = 8, flags: str = "") -> list[dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                          + f" --xla_force_host_platform_device_count={devices} {flags}").strip())
    done = subprocess.run([sys.executable, str(WORKER), *cases], env=env, capture_output=True, text=True,
                          timeout=600, cwd=WORKER.parent.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["device_count"] == devices
    return report["cases"]


def _check(case: dict, q_heads_split: bool, kv_heads_split: bool) -> None:
    tp, label = case["tensor_parallel"], f"{case['model']} tp={case['tensor_parallel']}"
    assert case["devices"] == tp, label
    heads, kv_heads = case["wq_shape"][1], case["wk_shape"][1]
    # each device holds its share of the heads and of the MLP (the sharding did happen)
    assert case["wq_shard"][1] == (heads // tp if q_heads_split else heads), label
    assert case["wk_shard"][1] == (kv_heads // tp if kv_heads_split else kv_heads), label
    assert case["kv_shard"][0] == case["wk_shard"][1], label  # loaded KV lies as the K projection does
    assert case["w_up_shard"][1] == case["w_up_shape"][1] // tp, label
    for system, diff in case["logit_diff"].items():  # retention 1.0: the single-device logits
        assert diff <= EXACT, (label, system, diff)
    for system, same in case["same_selections"].items():  # 25%: every layer the same tokens
        assert same and case["layers_compared"][system] == case["layers"], (label, system)
        one, many = case["fallback"][system]
        assert one == many, (label, system)
        assert case["pruned_logit_diff"][system] <= EXACT, (label, system)
    # both ITF paths ran: the probe heads' shared top-k, and the per-head fallback (H2O's union)
    assert not any(case["fallback"]["spec_shared"][0]) and all(case["fallback"]["as_h2o_lru"][0]), label
    _check_disk_bytes(case, kv_heads_split)


def _check_disk_bytes(case: dict, kv_heads_split: bool) -> None:
    """Each device's reader reads its own heads' share of the one-device run's bytes of every split kind (K and V,
    and the probe keys when they are split too); heads every device holds are read once."""
    tp, label = case["tensor_parallel"], f"{case['model']} tp={case['tensor_parallel']}"
    for system, disk in case["disk"].items():
        assert disk["many"] == disk["one"], (label, system)  # the same chunks, in all
        if system == "recompute":
            assert disk["one"] == 0 and disk["by_device"] == [], label  # reads nothing
        elif not kv_heads_split:
            assert disk["by_device"] == [], (label, system)  # replicated K/V: one whole read per chunk
        else:
            split = disk["one"] - (disk["one_probe"] if case["probe_parts"] == 1 else 0)
            assert split > 0 and split % tp == 0, (label, system, disk)
            assert disk["by_device"] == [split // tp] * tp, (label, system, disk)
    assert case["disk"]["spec"]["one_probe"] > 0, label  # spec's probe keys were read (and counted) too


@pytest.mark.slow
def test_tiny_models_match_one_device():
    """tiny-llama (4 query heads, 2 KV heads: KV replicated at tp=4, one each at tp=2) and tiny-opt (4 and 4: one
    each at tp=4)."""
    llama, llama2, opt = _worker("tiny-llama:4", "tiny-llama:2", "tiny-opt:4")
    assert llama["sharded_axes"] == ["ffw", "q_heads"]
    _check(llama, q_heads_split=True, kv_heads_split=False)
    assert llama2["sharded_axes"] == ["ffw", "kv_heads", "q_heads"]
    _check(llama2, q_heads_split=True, kv_heads_split=True)
    assert opt["sharded_axes"] == ["ffw", "kv_heads", "q_heads"]
    _check(opt, q_heads_split=True, kv_heads_split=True)


@pytest.mark.slow
def test_smollm2_matches_one_device():
    """smollm2-135m's shape (9 query heads, 3 KV heads) cut to 4 layers: at tp=4 only the MLP divides the mesh;
    at tp=3 every device has 3 query heads and their one KV head."""
    four, three = _worker("smollm2-135m:4", "smollm2-135m:3")
    assert four["sharded_axes"] == ["ffw"]
    _check(four, q_heads_split=False, kv_heads_split=False)
    assert three["sharded_axes"] == ["ffw", "kv_heads", "q_heads"]
    _check(three, q_heads_split=True, kv_heads_split=True)


# A collective whose participants have not all arrived aborts the process after this long (XLA's default: 60 s).
STUCK_FLAGS = ("--xla_cpu_collective_call_warn_stuck_timeout_seconds=5 "
               "--xla_cpu_collective_call_terminate_timeout_seconds=10")


@pytest.mark.slow
def test_deep_model_on_as_many_devices_as_the_mesh():
    """With exactly tensor_parallel forced devices, XLA's CPU client has no more threads than a collective needs, and
    a host far enough ahead of the devices starved an all-reduce (the process aborted, rc 134; `python -m
    specjax.eval --systems as_full,spec` did in spec's warm-up). Over 64 layers of real work each, the plain forward,
    then as_full and spec one after another, each with a continuation, run to the end: every loop over layers keeps
    to specjax.sharding.Pace."""
    (deep,) = _worker("deep:tiny-llama:2", devices=2, flags=STUCK_FLAGS)
    assert deep["devices"] == 2 and deep["layers"] == 64
    assert deep["ran"] == ["logits", "as_full", "spec"]
    assert all(deep["finite"].values()), deep["finite"]


def test_pace_waits_only_on_cpu_meshes():
    """A loop over arrays on several CPU devices waits, after each layer, for the layer PACE_LAYERS back; on one
    device (or none) and on accelerators it waits for nothing."""
    def on(*platforms):  # an array placed on devices of these platforms, as `paced` reads it
        devices = [types.SimpleNamespace(platform=p) for p in platforms]
        return types.SimpleNamespace(sharding=types.SimpleNamespace(device_set=devices))

    assert not any(map(sh.paced, [None, np.zeros(3), jnp.zeros(3), on("cpu"), on("gpu", "gpu")]))
    assert sh.paced(on("cpu", "cpu"))
    for like, waits in ((jnp.zeros(3), []), (on("cpu", "cpu"), list(range(4 - sh.PACE_LAYERS)))):
        waited = []
        pace = sh.Pace(like, waited.append)
        assert [pace.step(layer) for layer in range(4)] == [0, 1, 2, 3]
        assert waited == waits


def test_one_device_is_unchanged():
    """tensor_parallel=1 builds no mesh: parameters stay single-device arrays, as before."""
    model = specjax.load_model("tiny-llama", init="random", seed=1, tensor_parallel=1)
    assert model.mesh is None
    assert len(model.params["layers"][0]["wq"].sharding.device_set) == 1
    assert sh.describe(model.config, None) == {"tensor_parallel": 1, "sharded_axes": []}
    ref = specjax.load_model("tiny-llama", init="random", seed=1)
    np.testing.assert_array_equal(model.params["layers"][0]["wq"], ref.params["layers"][0]["wq"])


def test_plan_and_errors():
    cfg = specjax.load_model("tiny-llama", init="random").config  # 4 query heads, 2 KV heads, 128 MLP units

    class Mesh:  # plan only reads the mesh's size
        shape = {sh.TP: 2}

    assert sh.plan(cfg, Mesh) == {"q_heads": "tp", "kv_heads": "tp", "ffw": "tp"}
    Mesh.shape = {sh.TP: 3}
    assert sh.plan(cfg, Mesh) == {}  # nothing divides: all replicated
    with pytest.raises(SpecjaxError, match="tensor_parallel must be >= 1"):
        sh.make_mesh(0)
    with pytest.raises(SpecjaxError, match="xla_force_host_platform_device_count"):
        specjax.load_model("tiny-llama", init="random", tensor_parallel=64)
