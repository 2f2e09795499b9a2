"""One of several processes that run one sharded model together (specjax.distributed), for tests/test_distributed.py.

    python tests/distributed_worker.py HOST:PORT NUM_PROCESSES PROCESS_ID OUT_DIR MODEL...

Each process joins the runtime, loads every MODEL (a registered shape or a folder with its config.json) with random
weights (seed 1) split over all processes' devices, and writes OUT_DIR/<model>.process<ID>.npz: `outputs` (the
test computes the same in one process) and the first layer's query projection gathered whole. Its last stdout line
is a JSON object: the devices, which slices of the split parameters this process holds, and the errors that misuse
(a mesh short of a process, weights differing between processes) ends in.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import jax

jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py: fp32 references

import numpy as np  # noqa: E402

import specjax  # noqa: E402
from specjax import distributed, sharding  # noqa: E402
from specjax.engine import Engine, Request, make_system  # noqa: E402
from specjax.errors import SpecjaxError  # noqa: E402
from specjax.models import inference  # noqa: E402


def request(vocab: int, prefix_len: int = 100, query_len: int = 7, seed: int = 0) -> Request:
    rng = np.random.default_rng(seed)
    return Request(rng.integers(0, vocab, prefix_len).tolist(), rng.integers(0, vocab, query_len).tolist(),
                   continuations=[rng.integers(0, vocab, 3).tolist()])


def outputs(model) -> dict[str, np.ndarray]:
    """What is compared with one process: the plain forward's logits (Model.logits), the engine's recompute
    (first-token logits, a continuation's log-probability) and a few greedy tokens (the KV-cache decode)."""
    req = request(model.config.vocab_size)
    result = Engine(model, make_system("recompute"), None).run(req)
    ids = req.prefix + req.query
    return {
        "logits": model.logits(ids),
        "engine_first": result.first_token_logits,
        "engine_continuation": np.asarray(result.continuation_logprobs[0][0]),
        "greedy": np.asarray(inference.greedy_generate(model.config, model.params, ids, 4)),
    }


def _slices(x) -> list[dict]:
    """This process's shards of a global array: which part of it (start, stop per axis) and its shape."""
    return [{"index": [[s.start or 0, x.shape[i] if s.stop is None else s.stop] for i, s in enumerate(shard.index)],
             "shape": list(shard.data.shape)} for shard in x.addressable_shards]


def _error(load) -> str:
    try:
        load()
    except SpecjaxError as e:
        return str(e)
    return ""


def case(path: str, process_id: int, out: pathlib.Path) -> dict:
    start = time.perf_counter()
    tp = jax.device_count()
    model = specjax.load_model(path, init="random", seed=1, tensor_parallel=tp)
    layer = model.params["layers"][0]
    whole_wq = distributed.to_host(layer["wq"])  # gathered from both processes' devices
    np.savez(out / f"{pathlib.Path(path).name}.process{process_id}.npz", wq=whole_wq, **outputs(model))
    return {
        "model": pathlib.Path(path).name,
        "mesh_processes": sorted({d.process_index for d in model.mesh.devices.flat}),
        "mesh_devices": int(model.mesh.devices.size),
        "sharded_axes": sharding.describe(model.config, model.mesh)["sharded_axes"],
        "wq_fully_addressable": layer["wq"].is_fully_addressable,
        "wq_shape": list(layer["wq"].shape), "wq": _slices(layer["wq"]),
        "w_up_shape": list(layer["w_up"].shape), "w_up": _slices(layer["w_up"]),
        "short_mesh_error": _error(lambda: specjax.load_model(path, init="random", seed=1, tensor_parallel=2)),
        "other_seed_error": _error(lambda: specjax.load_model(path, init="random", seed=1 + process_id,
                                                              tensor_parallel=tp)),
        "seconds": time.perf_counter() - start,
    }


def main(coordinator: str, num_processes: str, process_id: str, out: str, *models: str) -> None:
    process_id = int(process_id)
    pathlib.Path(out).mkdir(parents=True, exist_ok=True)
    distributed.initialize(coordinator, int(num_processes), process_id, timeout_s=120)
    cases = [case(path, process_id, pathlib.Path(out)) for path in models]
    print(json.dumps({"process_index": jax.process_index(), "process_count": jax.process_count(),
                      "device_count": jax.device_count(), "local_device_count": jax.local_device_count(),
                      "cases": cases}))


if __name__ == "__main__":
    main(*sys.argv[1:])
