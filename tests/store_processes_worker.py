"""One of several processes that run the store's systems together on one sharded model and one shared store
(specjax.engine.processes), for tests/test_store_processes.py.

    python tests/store_processes_worker.py HOST:PORT NUM_PROCESSES PROCESS_ID OUT_DIR MODEL STORE SYSTEM...

Each process joins the runtime, loads MODEL (a registered shape or a folder with its config.json; the test's has 4 KV
heads, one per device of 2 processes x 2 devices) with random weights (seed 1) split over every process's devices,
and per SYSTEM runs `requests` on a store of its own under STORE (a folder, or a kvstore URL to which the system's
name is added) that every process opens; a SYSTEM named damaged-NAME runs `run_damaged` of NAME. It writes
OUT_DIR/<system>.process<ID>.npz (`results_arrays`) and, as its last stdout line, a JSON object of what each system
read per process. Process 0 writes the store; every process reads only its own heads.
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax

jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py: fp32 references

import numpy as np  # noqa: E402

import specjax  # noqa: E402
from specjax import distributed  # noqa: E402
from specjax.engine import EngineConfig, Request, make_engine, make_system  # noqa: E402
from specjax.errors import SpecjaxError  # noqa: E402
from specjax.engine import processes  # noqa: E402
from specjax.reuse import open_store  # noqa: E402
from specjax.stores import K  # noqa: E402

RETENTION = 0.25
PREFIX_TOKENS = (96, 128)
# every system's options as the test runs them: without speculation, whose guesses (and bytes) follow each process's
# measured host time
DAMAGED = "damaged-"  # a SYSTEM named so: `run_damaged` of the system after it
CAKE_CHUNK_TOKENS = 64  # the store's chunks: the 96- and 128-token prefixes in 2 chunks each
OPTIONS = {"spec": {"no_prefetch": True}, "spec_gqa": {"no_prefetch": True}, "planner": {"no_prefetch": True}}


def requests(vocab: int) -> list[Request]:
    """Two prefixes: the first stored before (`warm`), the second stored by its first request (written behind); each
    asked twice, every request with a query and two continuations; CacheBlend's chunks are the prefix's halves."""
    rng = np.random.default_rng(0)
    out = []
    for n in PREFIX_TOKENS:
        prefix = rng.integers(0, vocab, n).tolist()
        for _ in range(2):
            conts = [rng.integers(0, vocab, 3).tolist() for _ in range(2)]
            out.append(Request(prefix, rng.integers(0, vocab, 9).tolist(), conts,
                               chunks=[prefix[:n // 2], prefix[n // 2:]], index=len(out)))
    return out


def run_system(model, name: str, location) -> tuple[dict, dict]:
    """(arrays to compare, counts) of `name`'s requests on a store at `location`; a system that reorders the store
    repacks it after the first request."""
    system = make_system(name, **OPTIONS.get(name, {}))
    store = None
    if system.reuse:
        store = processes.opened_in_turn(lambda: open_store(model, location, system=name))  # made by process 0
    config = EngineConfig(retention=RETENTION, gpu_cache_bytes=64 << 10, cpu_cache_bytes=64 << 10, trace=True,
                          cake_chunk_tokens=CAKE_CHUNK_TOKENS)
    engine = make_engine(model, system, store, config)
    reqs = requests(model.config.vocab_size)
    if store is not None and name != "cacheblend":
        engine.warm(reqs[0].prefix)
    arrays, counts = {}, {"disk_bytes": [], "by_device": [], "reused": [], "split": []}
    for i, req in enumerate(reqs):
        if i == 1 and system.reorder:  # the first prefix repacked by what its first request observed
            engine.reorder()
        result = engine.run(req)
        arrays[f"first{i}"] = result.first_token_logits
        arrays[f"continuations{i}"] = np.asarray([lp for lp, _ in result.continuation_logprobs])
        for layer, chosen in enumerate(result.selections or []):
            arrays[f"selection{i}_{layer}"] = np.asarray(chosen)
        counts["disk_bytes"].append(int(result.io.get("disk_bytes", 0)))
        counts["by_device"].append([int(n) for n in result.disk_bytes_by_device])
        counts["reused"].append(int(result.reused_tokens))
        counts["split"].append(result.split)  # Cake's meeting point
    if store is not None:
        store.close()
    return arrays, counts


def run_damaged(model, name: str, location: str) -> tuple[dict, dict]:
    """`name`'s first two requests over a store folder whose first stored chunk has a byte flipped in its last KV
    head (process 1's, of two processes) before them, caches off: only that process finds the damage, every process
    recomputes the first request, the prefix is stored anew, and the second reuses it."""
    store = processes.opened_in_turn(lambda: open_store(model, location, system=name))
    config = EngineConfig(retention=RETENTION, gpu_cache_bytes=0, cpu_cache_bytes=0, trace=True)
    engine = make_engine(model, make_system(name, **OPTIONS.get(name, {})), store, config)
    reqs = requests(model.config.vocab_size)[:2]
    engine.warm(reqs[0].prefix)
    if processes.writes():
        key, offset = store.extent_of(1, K, sorted(store.stored_chunk_ids())[0])
        path = pathlib.Path(location) / key
        data = bytearray(path.read_bytes())
        data[offset + store.layout.chunk_nbytes(K) * 7 // 8] ^= 0xFF
        path.write_bytes(bytes(data))
    if jax.process_count() > 1:
        distributed.barrier("specjax-test-damage")
    arrays, counts = {}, {"recomputed": [], "reused": [], "bad_chunks": []}
    for i, req in enumerate(reqs):
        result = engine.run(req)
        arrays[f"first{i}"] = result.first_token_logits
        arrays[f"continuations{i}"] = np.asarray([lp for lp, _ in result.continuation_logprobs])
        counts["recomputed"].append(bool(result.recomputed_bad_chunks))
        counts["reused"].append(int(result.reused_tokens))
        counts["bad_chunks"].append(int(result.io.get("bad_chunks", 0)))
    counts["repaired"] = len(engine.repaired)
    store.close()
    return arrays, counts


def location_of(store: str, name: str):
    """The store of system `name` under STORE: a subfolder, or for a kvstore URL ("file:///x", "file:///x|ocdbt")
    the system's name added to its first part's path."""
    if "://" not in store:
        return str(pathlib.Path(store) / name)
    base, bar, driver = store.partition("|")
    return f"{base.rstrip('/')}/{name}/{bar}{driver}"


def main(coordinator: str, num_processes: str, process_id: str, out: str, model: str, store: str,
         *systems: str) -> None:
    process_id = int(process_id)
    distributed.initialize(coordinator, int(num_processes), process_id, timeout_s=120)
    model = specjax.load_model(model, init="random", seed=1, tensor_parallel=jax.device_count())
    report = {"process_index": jax.process_index(), "systems": {}, "errors": {}}
    for name in systems:
        try:
            run = run_damaged if name.startswith(DAMAGED) else run_system
            arrays, counts = run(model, name.removeprefix(DAMAGED), location_of(store, name))
        except SpecjaxError as e:
            report["errors"][name] = str(e)
            continue
        np.savez(pathlib.Path(out) / f"{name}.process{process_id}.npz", **arrays)
        report["systems"][name] = counts
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
