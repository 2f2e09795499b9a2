"""Tensor-parallel engine runs against one device, in a process of its own (tests/test_tensor_parallel.py).

JAX must see several devices before it starts, so the test runs this file with
XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu and reads one JSON object from its last line:
per (model, tensor_parallel) case, the parameters' placement, the largest first-token logit difference of each
system at retention 1.0 and whether every layer's selections at a lower retention equal one device's.

    python tests/tp_worker.py tiny-llama:4 tiny-opt:4 smollm2-135m:3

A case `deep:NAME:N` instead runs a deeper, wider copy of NAME (DEEP_SHAPE) at tensor_parallel=N as an evaluation's
systems run one after another (`deep`); the test runs it with as many forced devices as the mesh has.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import tempfile
import time

import jax

jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py: fp32 references

import numpy as np  # noqa: E402
import tensorstore as ts  # noqa: E402

import specjax  # noqa: E402
from specjax import sharding as sh  # noqa: E402
from specjax.config import from_hf_config, save_config  # noqa: E402
from specjax.configs.models import MODEL_SHAPES  # noqa: E402
from specjax.engine import Engine, EngineConfig, Request, fingerprint, make_system  # noqa: E402
from specjax.stores import KVStore  # noqa: E402

FULL = ("recompute", "as_full", "spec")  # at retention 1.0: the single-device logits
# at PRUNED_RETENTION: the single-device selections. spec as configured (on random weights its probe heads
# mostly disagree: per-head H2O), spec with a threshold its probe heads always reach (their shared top-k), H2O.
# spec without speculation: what a guess reads depends on the host's measured timing (`Speculator.pays`, its
# budget), not on the mesh alone, so its bytes would not compare across runs
PRUNED = {"spec": ("spec", {"no_prefetch": True}), "spec_shared": ("spec", {"alpha": 50.0, "no_prefetch": True}),
          "as_h2o_lru": ("as_h2o_lru", {})}
PRUNED_RETENTION = 0.25
LAYERS = 4  # larger shapes are cut to this many layers (the per-layer work is the same)
# `deep` cases: a copy of the shape with enough layers, each with enough device work over a DEEP_TOKENS-token prefix
# and a DEEP_CONTINUATION-token continuation, that a host dispatching every layer before waiting queues far more
# programs than XLA's CPU client runs without starving a collective (specjax.sharding.PACE_LAYERS)
DEEP_SHAPE = {"num_layers": 64, "hidden_size": 256, "num_heads": 8, "num_kv_heads": 4, "head_dim": 32,
              "intermediate_size": 1024}
DEEP_TOKENS, DEEP_CONTINUATION = 1000, 500
DEEP_SYSTEMS = ("as_full", "spec")  # in this order, on one model, as `--systems as_full,spec` runs them


def _model_path(name: str, folder: pathlib.Path, **changes) -> str:
    """A registered shape, or a copy of it with `changes` to its config (default: at most LAYERS layers), a folder
    with its config.json."""
    cfg = from_hf_config(MODEL_SHAPES[name])
    changes = changes or {"num_layers": min(cfg.num_layers, LAYERS)}
    if all(getattr(cfg, field) == value for field, value in changes.items()):
        return name
    path = folder / "-".join([name, *(f"{field}{value}" for field, value in sorted(changes.items()))])
    path.mkdir(parents=True, exist_ok=True)
    save_config(dataclasses.replace(cfg, **changes), path / "config.json")
    return str(path)


def _request(model, prefix_len=100, query_len=7, seed=0) -> Request:
    rng = np.random.default_rng(seed)
    v = model.config.vocab_size
    return Request(rng.integers(0, v, prefix_len).tolist(), rng.integers(0, v, query_len).tolist())


def _run(model, name: str, req: Request, retention: float, **options):
    system = make_system(name, **options)
    store = None
    if system.reuse:
        spec = {"driver": "memory", "path": f"kv{np.random.randint(1 << 30)}/"}
        store = KVStore.open(spec, fingerprint(model, 16), context=ts.Context())
    config = EngineConfig(retention=retention, gpu_cache_bytes=64 << 10, cpu_cache_bytes=64 << 10, trace=True)
    engine = Engine(model, system, store, config)
    if store is not None:
        engine.warm(req.prefix)
    return engine.run(req)


def _placement(model) -> dict:
    wq = model.params["layers"][0]["wq"]
    wk = model.params["layers"][0]["wk"]
    up = model.params["layers"][0]["w_up"]
    return {
        "devices": len(wq.sharding.device_set),
        "wq_shape": list(wq.shape), "wq_shard": list(wq.addressable_shards[0].data.shape),
        "wk_shape": list(wk.shape), "wk_shard": list(wk.addressable_shards[0].data.shape),
        "w_up_shape": list(up.shape), "w_up_shard": list(up.addressable_shards[0].data.shape),
        "sharded_axes": sh.describe(model.config, model.mesh)["sharded_axes"],
    }


_ONE: dict = {}  # model name -> (its one-device model, {(system, retention, options): result})


def case(name: str, tp: int, folder: pathlib.Path) -> dict:
    path = _model_path(name, folder)
    if name not in _ONE:
        _ONE[name] = specjax.load_model(path, init="random", seed=1), {}
    one, done = _ONE[name]
    many = specjax.load_model(path, init="random", seed=1, tensor_parallel=tp)

    def single(system, retention, **options):  # one device's result, once per model
        key = (system, retention, tuple(sorted(options.items())))
        if key not in done:
            done[key] = _run(one, system, req, retention, **options)
        return done[key]

    req = _request(one)
    out = {"model": name, "tensor_parallel": tp, "layers": one.config.num_layers, **_placement(many),
           "logit_diff": {}, "pruned_logit_diff": {}, "same_selections": {}, "layers_compared": {},
           "fallback": {}, "disk": {}}
    # the KV a sharded engine reads is split by head as it enters the device
    engine = Engine(many, make_system("recompute"), None)
    kv = engine.place_kv(np.zeros((many.config.num_kv_heads, 16, many.config.head_dim), np.float32))
    out["kv_devices"], out["kv_shard"] = len(kv.sharding.device_set), list(kv.addressable_shards[0].data.shape)
    probe_heads = fingerprint(many, 16)["probe_heads"]  # how many devices split the stored probe keys' heads
    out["probe_parts"] = sh.kv_parts(many.config, many.mesh, probe_heads)
    for system in FULL:
        a, b = single(system, 1.0), _run(many, system, req, 1.0)
        out["logit_diff"][system] = float(np.abs(a.first_token_logits - b.first_token_logits).max())
        out["disk"][system] = _disk(a, b)
    for label, (system, options) in PRUNED.items():
        a, b = single(system, PRUNED_RETENTION, **options), _run(many, system, req, PRUNED_RETENTION, **options)
        out["same_selections"][label] = (len(a.selections) == len(b.selections) and all(
            np.array_equal(x, y) for x, y in zip(a.selections, b.selections)))
        out["layers_compared"][label] = len(a.selections)
        out["pruned_logit_diff"][label] = float(np.abs(a.first_token_logits - b.first_token_logits).max())
        out["fallback"][label] = [a.layers["fallback"], b.layers["fallback"]]
        out["disk"][label] = _disk(a, b)
    return out


def deep(name: str, tp: int, folder: pathlib.Path) -> dict:
    """NAME's DEEP_SHAPE at tensor_parallel=`tp`: the plain forward's logits of a DEEP_TOKENS-token prefix, then
    DEEP_SYSTEMS one after another (at PRUNED_RETENTION), each from a store holding the prefix, on a request with a
    DEEP_CONTINUATION-token continuation, and how long each took. That each finished is the point: a host that
    outruns the devices aborts the process."""
    model = specjax.load_model(_model_path(name, folder, **DEEP_SHAPE), init="random", seed=1, tensor_parallel=tp)
    req = _request(model, prefix_len=DEEP_TOKENS)
    req.continuations = [np.random.default_rng(1).integers(0, model.config.vocab_size, DEEP_CONTINUATION).tolist()]
    out = {"model": name, "tensor_parallel": tp, "layers": model.config.num_layers,
           "devices": len(model.params["embed"].sharding.device_set), "ran": [], "took": {}, "finite": {}}
    t = time.perf_counter()
    logits = model.logits(req.prefix)
    out["ran"].append("logits")
    out["took"]["logits"], out["finite"]["logits"] = time.perf_counter() - t, bool(np.isfinite(logits).all())
    for system in DEEP_SYSTEMS:
        t = time.perf_counter()
        result = _run(model, system, req, PRUNED_RETENTION)
        out["ran"].append(system)
        out["took"][system] = time.perf_counter() - t
        out["finite"][system] = bool(np.isfinite(result.first_token_logits).all()
                                     and np.isfinite(result.continuation_logprobs[0][0]))
    return out


def _disk(one, many) -> dict:
    """Disk bytes of the one-device and the sharded run, and what each device's reader read of its own heads."""
    return {"one": one.io.get("disk_bytes", 0), "one_probe": one.io.get("probe_disk_bytes", 0),
            "many": many.io.get("disk_bytes", 0), "by_device": many.disk_bytes_by_device}


def main(args: list[str]) -> None:
    start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for arg in args:
            kind, name, tp = arg.rsplit(":", 2) if arg.startswith("deep:") else ("case", *arg.rsplit(":", 1))
            run = deep if kind == "deep" else case
            t = time.perf_counter()
            results.append(run(name, int(tp), pathlib.Path(folder)) | {"seconds": time.perf_counter() - t})
    print(json.dumps({"device_count": jax.device_count(), "cases": results,
                      "seconds": time.perf_counter() - start}))


if __name__ == "__main__":
    main(sys.argv[1:])
