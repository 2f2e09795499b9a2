"""The prefetcher's take path alone, at a model's KV geometry with no model: the host time a request's reads cost
from the store to the device, for chunk sizes side by side in one run (same store bytes, same machine).

Per request, as the engine does: every layer's keys requested at the start (the certain reads of H2O and of spec_gqa),
every position located once per layer; then per layer a take of all keys, and a request and a take of the values of a
random share of the positions (a layer's selection). The first request fills the caches and compiles; the median of
the timed ones after it is reported: wall time, and the CPU time of the process and of the requesting thread, which a
machine shared with other work disturbs less. The store is on the local disk (the page cache on, unless --direct_io).

    python benchmarks/take_path.py                                        # Qwen2.5-7B's KV, 4k tokens, caches off
    python benchmarks/take_path.py --model smollm2-135m --prefix_tokens 1024 --caches 0.15,0.5 --policy spec_score
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _common import device_name  # noqa: E402  (benchmarks/_common.py)
from specjax.config import from_hf_config  # noqa: E402
from specjax.configs.models import MODEL_SHAPES  # noqa: E402
from specjax.stores import K, V, KVStore, Locations  # noqa: E402
from specjax.stores.caches import TieredCache  # noqa: E402
from specjax.stores.prefetch import Prefetcher  # noqa: E402


def geometry(model: str) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of a registered model shape."""
    if model not in MODEL_SHAPES:
        raise SystemExit(f"unknown model shape {model!r}; choose one of {', '.join(sorted(MODEL_SHAPES))}")
    c = from_hf_config(MODEL_SHAPES[model])
    return c.num_layers, c.num_kv_heads, c.head_dim


def measure(model: str, tokens: int, chunk_tokens: int, *, caches=(0.0, 0.0), policy: str = "lfu",
            value_share: float = 0.7, requests: int = 3, direct_io: bool = False, where: str | None = None) -> dict:
    """One configuration: a store of `tokens` positions in `chunk_tokens`-token chunks (removed after), then
    1 + `requests` requests."""
    layers, kv_heads, head_dim = geometry(model)
    fp = {"arch": model, "num_layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "probe_heads": 0,
          "chunk_tokens": chunk_tokens, "dtype": "bfloat16"}
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((kv_heads, tokens, head_dim)).astype(jax.numpy.bfloat16)
    path = tempfile.mkdtemp(prefix="take_path-", dir=where)
    try:
        return _requests(path, fp, kv, tokens, caches, policy, value_share, requests, direct_io) | {
            "model": model, "prefix_tokens": tokens, "chunk_tokens": chunk_tokens, "caches": list(caches),
            "policy": policy, "value_share": value_share, "direct_io": direct_io, "requests": requests}
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _requests(path, fp, kv, tokens, caches, policy, value_share, requests, direct_io) -> dict:
    """A store of the prefix at `path`, then 1 + `requests` requests through one prefetcher (the first untimed)."""
    layers = fp["num_layers"]
    with KVStore.open(path, fp) as store:
        store.insert(np.arange(tokens), [(kv, kv, None)] * layers)
    store = KVStore.open(path, fp, direct_io=direct_io)
    request_bytes = layers * 2 * store.layout.token_nbytes(K) * tokens
    cache = TieredCache(int(caches[0] * request_bytes), int(caches[1] * request_bytes), policy,
                        metrics=store.metrics)
    prefetcher = Prefetcher(store, cache)
    positions = np.arange(tokens)
    rng = np.random.default_rng(1)
    times = []
    try:
        for i in range(requests + 1):
            if i == 1:
                store.metrics.reset()
            match = store.match(positions)
            start, cpu, own_cpu = time.perf_counter(), time.process_time(), time.thread_time()
            every = [store.locate(match, positions, layer) for layer in range(layers)]
            for layer in range(layers):
                prefetcher.request(match, layer, K, chunks=every[layer].unique_chunks())
            for layer in range(layers):
                prefetcher.take(match, layer, K, positions, pad_to=tokens, loc=every[layer])
                chosen = np.sort(rng.choice(tokens, int(value_share * tokens), replace=False))
                loc = Locations(every[layer].chunks[chosen], every[layer].offsets[chosen])
                prefetcher.request(match, layer, V, chunks=loc.unique_chunks())
                jax.block_until_ready(prefetcher.take(match, layer, V, chosen, pad_to=tokens, loc=loc).array)
            own_cpu = time.thread_time() - own_cpu  # read inside the process's interval: never more than it
            elapsed = (time.perf_counter() - start, time.process_time() - cpu, own_cpu)
            prefetcher.close()
            match.close()
            if i:
                times.append(elapsed)
        counters = store.metrics.snapshot()
    finally:
        store.close()
    wall, cpu, own_cpu = zip(*times)
    return {"ms_per_request": statistics.median(wall) * 1e3, "cpu_ms_per_request": statistics.median(cpu) * 1e3,
            "thread_cpu_ms_per_request": statistics.median(own_cpu) * 1e3,
            **{key: counters[key] / requests for key in ("read_requests", "chunks_read", "disk_bytes", "misses")}}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python benchmarks/take_path.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-7b", help="a registered model shape (its KV geometry only)")
    p.add_argument("--prefix_tokens", type=int, default=4096)
    p.add_argument("--chunk_tokens", default="16,64", help="comma-separated: each is measured, in this order")
    p.add_argument("--caches", default="0,0", help="device,host cache budgets as shares of a request's KV bytes")
    p.add_argument("--policy", default="lfu")
    p.add_argument("--value_share", type=float, default=0.7, help="share of positions whose values a layer takes")
    p.add_argument("--requests", type=int, default=3, help="timed requests per configuration (after one untimed)")
    p.add_argument("--direct_io", action="store_true", help="read with O_DIRECT (the page cache off)")
    p.add_argument("--dir", default=None, help="where the stores are written (default: the system's temp dir)")
    p.add_argument("--output", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    caches = tuple(float(x) for x in args.caches.split(","))
    rows = []
    print(f"# {device_name()}, jax {jax.__version__}: {args.model} KV, {args.prefix_tokens} tokens, caches {caches} "
          f"({args.policy}), values of {args.value_share:.0%} of positions per layer", flush=True)
    for chunk in (int(x) for x in args.chunk_tokens.split(",")):
        row = measure(args.model, args.prefix_tokens, chunk, caches=caches, policy=args.policy,
                      value_share=args.value_share, requests=args.requests, direct_io=args.direct_io,
                      where=args.dir)
        rows.append(row)
        print(f"chunk {chunk:3d}: {row['ms_per_request']:7.1f} ms per request (CPU {row['cpu_ms_per_request']:.1f} ms, "
              f"{row['thread_cpu_ms_per_request']:.1f} of them on the requesting thread); {row['read_requests']:.0f} "
              f"reads, {row['chunks_read']:.0f} chunks, {row['disk_bytes'] / 1e6:.1f} MB", flush=True)
    if args.output:
        pathlib.Path(args.output).write_text(json.dumps({"device": device_name(), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
