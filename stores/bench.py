"""`python -m specjax.stores.bench`: store chunk reads vs plain `os.preadv` on the same files, and throttle accuracy.

Both sides bypass the page cache with O_DIRECT (TensorStore `file_io_mode: direct`; `O_DIRECT` + aligned
buffers for preadv), so numbers are the disk's. The throttle line is emulated bandwidth and says so.

`--compare_layouts` instead compares on-disk layouts of one layer's K: the store's one file per chunk against zarr3
`sharding_indexed` shards of S chunks, read as the engine reads (concurrent runs of adjacent chunks, each one
TensorStore read), with the raw preadv rate of the chunk files beside them, and the write/delete cost of each.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import mmap
import os
import platform
import shutil
import sys
import time

import numpy as np
import tensorstore as ts

from specjax.stores.kvarray import K, MAX_CHUNKS, PROBE, Layout, _array_spec, make_context
from specjax.stores.store import KVStore

ALIGN = 4096
PAGE_CACHE = "bypassed with O_DIRECT (TensorStore file_io_mode=direct; os.O_DIRECT for preadv)"


def _fill(directory: str, chunk_tokens: int, tokens: int, kv_heads: int, head_dim: int) -> dict:
    fp = {"arch": "bench", "num_layers": 1, "kv_heads": kv_heads, "head_dim": head_dim, "probe_heads": 0,
          "chunk_tokens": chunk_tokens, "dtype": "float32"}
    shutil.rmtree(directory, ignore_errors=True)
    rng = np.random.default_rng(chunk_tokens)
    k = rng.standard_normal((kv_heads, tokens, head_dim)).astype(np.float32)
    with KVStore.open(directory, fp) as store:
        store.insert(np.arange(tokens), [(k, k, None)])
    return fp


def chunk_path(directory: str, chunk: int, layer: int = 0, kind: int = K) -> str:
    """The file of one chunk: zarr3 default key encoding of `kv[layer, kind, :, chunk, :]`, or of
    `probe[layer, :, chunk, :]` for PROBE."""
    if kind == PROBE:
        return os.path.join(directory, "probe", "c", str(layer), "0", str(chunk), "0")
    return os.path.join(directory, "kv", "c", str(layer), str(kind), "0", str(chunk), "0")


def _time_store(directory: str, fp: dict, chunks: np.ndarray, **open_kwargs) -> tuple[float, int]:
    with KVStore.open(directory, fp, direct_io=True, **open_kwargs) as store:
        start = time.perf_counter()
        futures = [store.read_chunk(0, K, int(c)) for c in chunks]
        arrays = [f.result() for f in futures]
        elapsed = time.perf_counter() - start
    if any(a is None for a in arrays):
        raise RuntimeError("a benchmark chunk failed its checksum")
    return elapsed, sum(a.nbytes for a in arrays)


def read_direct(pool: concurrent.futures.Executor, paths, nbytes: int) -> int:
    """Read each file (at most `nbytes`) on `pool`, in order: open with O_DIRECT, one `os.preadv` into a
    page-aligned buffer, close. Returns the bytes read."""
    def read_one(path: str) -> int:
        buf = mmap.mmap(-1, -(-nbytes // ALIGN) * ALIGN)  # page-aligned, as O_DIRECT requires
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            return os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
            buf.close()

    return sum(pool.map(read_one, paths))


def _time_preadv(directory: str, chunks: np.ndarray, nbytes: int, threads: int) -> float:
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        got = read_direct(pool, [chunk_path(directory, int(c)) for c in chunks], nbytes)
        elapsed = time.perf_counter() - start
    if got != nbytes * len(chunks):
        raise RuntimeError(f"preadv read {got} bytes, expected {nbytes * len(chunks)}")
    return elapsed


def bench_chunk_size(directory: str, chunk_tokens: int, tokens: int, kv_heads: int, head_dim: int,
                     fraction: float, repeats: int, threads: int) -> dict:
    fp = _fill(directory, chunk_tokens, tokens, kv_heads, head_dim)
    n_chunks = tokens // chunk_tokens
    chunk_bytes = kv_heads * chunk_tokens * head_dim * 4
    rng = np.random.default_rng(0)
    store_s, preadv_s = [], []
    for _ in range(repeats):
        chunks = rng.choice(n_chunks, max(1, int(fraction * n_chunks)), replace=False)
        # alternate the order so neither side profits from the other warming the device
        store_s.append(_time_store(directory, fp, chunks)[0])
        preadv_s.append(_time_preadv(directory, rng.permutation(chunks), chunk_bytes, threads))
    n_read = max(1, int(fraction * n_chunks))
    total = n_read * chunk_bytes
    s, p = float(np.median(store_s)), float(np.median(preadv_s))
    return {"chunk_tokens": chunk_tokens, "chunk_bytes": chunk_bytes, "chunks_read": n_read,
            "store_ms": s * 1e3, "preadv_ms": p * 1e3, "store_MBps": total / s / 1e6,
            "preadv_MBps": total / p / 1e6, "store_over_preadv_time": s / p}


def bench_throttle(directory: str, fp: dict, tokens: int, bandwidth: float) -> dict:
    chunks = np.arange(tokens // fp["chunk_tokens"])
    elapsed, nbytes = _time_store(directory, fp, chunks, disk_bandwidth=bandwidth)
    rate = nbytes / elapsed
    return {"setting_MBps": bandwidth / 1e6, "delivered_MBps": rate / 1e6,
            "error": abs(rate - bandwidth) / bandwidth, "emulated": True}


# --- layout comparison (--compare_layouts): chunk files vs zarr3 sharding_indexed ------------------------------

COST_RUN = 4  # chunks per write / delete in the store-cost measurement


def layout_name(shard: int) -> str:
    return f"shard{shard}" if shard else "chunks"


def layout_spec(directory: str, lay: Layout, shard: int) -> dict:
    """zarr3 spec of `kv[1, 2, kv_heads, slots, head_dim]` as the store lays it out (`shard` 0: one file per chunk),
    or as `sharding_indexed` shards of `shard` chunks along the slot axis whose inner chunk is one store chunk."""
    chunk = [1, 1, lay.kv_heads, lay.chunk_tokens, lay.head_dim]
    spec = _array_spec({"driver": "file", "path": directory}, "kv",
                       [1, 2, lay.kv_heads, MAX_CHUNKS * lay.chunk_tokens, lay.head_dim], chunk, lay.dtype)
    if shard:
        meta = spec["metadata"]
        meta["chunk_grid"]["configuration"]["chunk_shape"] = [1, 1, lay.kv_heads, shard * lay.chunk_tokens,
                                                              lay.head_dim]
        meta["codecs"] = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": chunk, "codecs": meta["codecs"], "index_location": "end",
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]}}]
    return spec


def layout_context(cache_bytes: int = 0) -> ts.Context:
    """The store's context (O_DIRECT, `make_context`) with a cache pool of `cache_bytes` (the store uses 0)."""
    spec = make_context(direct_io=True).spec.to_json()
    spec["cache_pool"] = {"total_bytes_limit": cache_bytes}
    return ts.Context(spec)


def open_layout(directory: str, lay: Layout, shard: int, cache_bytes: int = 0, create: bool = False):
    mode = {"create": True, "delete_existing": True} if create else {"open": True}
    return ts.open(layout_spec(directory, lay, shard), context=layout_context(cache_bytes), **mode).result()


def random_layer(lay: Layout, n_chunks: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((lay.kv_heads, n_chunks * lay.chunk_tokens, lay.head_dim)).astype(lay.np_dtype)


def file_counters() -> dict:
    """TensorStore's process-wide file kvstore counters: reads after batching, bytes read and written, writes."""
    names = {"batch_read": "file_reads", "bytes_read": "bytes_read", "write": "file_writes",
             "bytes_written": "bytes_written"}
    out = dict.fromkeys(names.values(), 0)
    for metric in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/"):
        key = names.get(metric["name"].rsplit("/", 1)[-1])
        if key:
            out[key] = sum(v.get("value", 0) for v in metric["values"])
    return out


def _timed(fn) -> tuple[float, object, dict]:
    """Run `fn()`; returns its seconds, its result and the file counters it moved."""
    before = file_counters()
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    after = file_counters()
    return elapsed, result, {k: after[k] - before[k] for k in after}


def pick_runs(rng: np.random.Generator, n_chunks: int, run: int, n_runs: int) -> np.ndarray:
    """Start chunks of up to `n_runs` non-overlapping runs of `run` adjacent chunks at random positions."""
    used = np.zeros(n_chunks, bool)
    starts = []
    for s in rng.permutation(n_chunks - run + 1):
        if len(starts) == n_runs:
            break
        if not used[s:s + run].any():
            used[s:s + run] = True
            starts.append(int(s))
    return np.array(starts)


def _run_view(arr, lay: Layout, first: int, n: int):
    return arr[0, K, :, first * lay.chunk_tokens:(first + n) * lay.chunk_tokens]


def read_runs(arr, lay: Layout, starts, run: int) -> list[np.ndarray]:
    """One array read per run, all issued before any is waited for: the same reads for every layout compared (the
    engine reads its one-file-per-chunk layout's files through the kvstore instead; a sharded layout needs the
    array driver to find a chunk inside its shard)."""
    futures = [_run_view(arr, lay, int(s), run).read() for s in starts]
    return [f.result() for f in futures]


def warm_shard_index(arr, lay: Layout, starts, run: int, shard: int, n_chunks: int) -> None:
    """Per shard the runs touch, read one chunk outside the runs: loads that shard's index into the cache pool and
    no data the timed reads ask for."""
    used = {int(s) + j for s in starts for j in range(run)}
    firsts = [next((c for c in range(sh * shard, min(sh * shard + shard, n_chunks)) if c not in used), None)
              for sh in sorted({c // shard for c in used})]
    read_runs(arr, lay, [c for c in firsts if c is not None], 1)


def _measure_store(directory: str, lay: Layout, shard: int, cache_bytes: int, data: np.ndarray, starts,
                   run: int) -> tuple[float, dict]:
    arr = open_layout(directory, lay, shard, cache_bytes)
    if cache_bytes:
        warm_shard_index(arr, lay, starts, run, shard, data.shape[1] // lay.chunk_tokens)
    elapsed, arrays, counts = _timed(lambda: read_runs(arr, lay, starts, run))
    c = lay.chunk_tokens
    if not all(np.array_equal(a, data[:, s * c:(s + run) * c]) for a, s in zip(arrays, starts)):
        raise RuntimeError(f"{layout_name(shard)} read back other data than was written")
    return elapsed, counts


def _measure_preadv(directory: str, lay: Layout, starts, run: int, threads: int) -> tuple[float, dict]:
    chunks = np.array([s + j for s in starts for j in range(run)])
    nbytes = lay.chunk_nbytes(K)
    return _time_preadv(directory, chunks, nbytes, threads), {"file_reads": len(chunks),
                                                              "bytes_read": len(chunks) * nbytes}


def store_costs(directory: str, lay: Layout, shard: int, data: np.ndarray, write_s: float, seed: int,
                repeats: int) -> dict:
    """Files of the written layer, then the median time and file traffic of writing new data over a run of
    COST_RUN chunks and of deleting (writing the fill value over) another, at random positions."""
    n_chunks = data.shape[1] // lay.chunk_tokens
    starts = pick_runs(np.random.default_rng(seed), n_chunks, COST_RUN, 2 * repeats)
    arr = open_layout(directory, lay, shard)
    files = sum(len(f) for _, _, f in os.walk(os.path.join(directory, "kv", "c")))
    row = {"layout": layout_name(shard), "files": files, "write_layer_ms": write_s * 1e3}
    new_data = -data[:, :COST_RUN * lay.chunk_tokens]
    for op, part, value in (("write_run", starts[:repeats], new_data), ("delete_run", starts[repeats:], 0)):
        samples = [_timed(lambda: _run_view(arr, lay, int(s), COST_RUN).write(value).result()) for s in part]
        row[f"{op}_ms"] = float(np.median([t for t, _, _ in samples])) * 1e3
        for key in ("bytes_read", "bytes_written", "file_writes"):
            row[f"{op}_{key}"] = int(np.median([c[key] for _, _, c in samples]))
    return row


def _read_row(lay: Layout, shard, cache: int, run: int, n_reads: int, samples: list) -> dict:
    """One table row from the (seconds, file counters) of each repeat: medians, and the time range."""
    nbytes, times = n_reads * run * lay.chunk_nbytes(K), [t for t, _ in samples]
    s = float(np.median(times))
    return {"dtype": lay.dtype, "layout": shard if shard == "preadv" else layout_name(shard),
            "index_cache_MiB": cache / 2**20, "run_chunks": run, "reads": n_reads, "bytes": nbytes,
            "ms": s * 1e3, "ms_min": min(times) * 1e3, "ms_max": max(times) * 1e3, "MBps": nbytes / s / 1e6,
            "reads_per_s": n_reads / s, "file_reads": int(np.median([c["file_reads"] for _, c in samples])),
            "bytes_read": int(np.median([c["bytes_read"] for _, c in samples]))}


def compare_layouts(directory: str, lay: Layout, tokens: int, shards, runs, fraction: float, repeats: int,
                    threads: int, index_cache_bytes: int) -> dict:
    """Write one random layer of K in each layout, then time concurrent reads of runs of `runs` chunks covering
    `fraction` of the layer: median of `repeats`, layouts in alternating order, every read checked against the data."""
    n_chunks = tokens // lay.chunk_tokens
    data = random_layer(lay, n_chunks)
    dirs = {s: os.path.join(directory, f"{lay.dtype}_{layout_name(s)}") for s in [0, *shards]}
    write_s = {}
    for shard, d in dirs.items():
        arr = open_layout(d, lay, shard, create=True)
        write_s[shard] = _timed(lambda: _run_view(arr, lay, 0, n_chunks).write(data).result())[0]
    configs = [(0, 0)] + [(s, c) for s in shards for c in sorted({0, index_cache_bytes})] + [("preadv", 0)]
    rng = np.random.default_rng(1)
    rows = []
    for run in runs:
        samples = collections.defaultdict(list)
        starts = []
        for rep in range(repeats):
            starts = pick_runs(rng, n_chunks, run, max(1, round(fraction * n_chunks / run)))
            for shard, cache in configs[::-1] if rep % 2 else configs:
                samples[shard, cache].append(
                    _measure_preadv(dirs[0], lay, starts, run, threads) if shard == "preadv"
                    else _measure_store(dirs[shard], lay, shard, cache, data, starts, run))
        rows += [_read_row(lay, shard, cache, run, len(starts), got) for (shard, cache), got in samples.items()]
    costs = [dict(store_costs(d, lay, s, data, write_s[s], 2, repeats), dtype=lay.dtype) for s, d in dirs.items()]
    return {"reads": rows, "store_costs": costs}


def print_layouts(results: dict) -> None:
    chunks_ms = {(r["dtype"], r["run_chunks"]): r["ms"] for r in results["reads"] if r["layout"] == "chunks"}
    print(f"{'dtype':9} {'layout':8} {'idx MiB':>7} {'run':>3} {'reads':>5} {'ms':>8} {'MB/s':>7} {'reads/s':>8} "
          f"{'file reads':>10} {'vs chunks':>9}")
    for r in results["reads"]:
        print(f"{r['dtype']:9} {r['layout']:8} {r['index_cache_MiB']:7g} {r['run_chunks']:3d} {r['reads']:5d} "
              f"{r['ms']:8.1f} {r['MBps']:7.1f} {r['reads_per_s']:8.0f} {r['file_reads']:10d} "
              f"{chunks_ms[r['dtype'], r['run_chunks']] / r['ms']:8.2f}x")
    print(f"\n{'dtype':9} {'layout':8} {'files':>6} {'write layer ms':>14} | write {COST_RUN} chunks: "
          f"{'ms':>6} {'KiB read':>8} {'KiB written':>11} | delete {COST_RUN}: {'ms':>6} {'KiB written':>11}")
    for c in results["store_costs"]:
        print(f"{c['dtype']:9} {c['layout']:8} {c['files']:6d} {c['write_layer_ms']:14.1f} | {'':15}"
              f"{c['write_run_ms']:6.1f} {c['write_run_bytes_read'] / 1024:8.0f} "
              f"{c['write_run_bytes_written'] / 1024:11.0f} | {'':10}{c['delete_run_ms']:6.1f} "
              f"{c['delete_run_bytes_written'] / 1024:11.0f}")


def run_layout_comparison(args) -> dict:
    results = {"page_cache": PAGE_CACHE,
               "machine": f"{platform.machine()}, {os.cpu_count()} cores", "reads": [], "store_costs": [],
               "config": {k: getattr(args, k) for k in ("tokens", "kv_heads", "head_dim", "chunk_tokens", "fraction",
                                                        "repeats", "threads", "runs", "shard_chunks", "dtypes",
                                                        "index_cache_MiB")}}
    for dtype in args.dtypes.split(","):
        lay = Layout(1, args.kv_heads, args.head_dim, 0, int(args.chunk_tokens), dtype)
        got = compare_layouts(args.dir, lay, args.tokens, [int(s) for s in args.shard_chunks.split(",")],
                              [int(r) for r in args.runs.split(",")], args.fraction, args.repeats, args.threads,
                              int(args.index_cache_MiB * 2**20))
        results["reads"] += got["reads"]
        results["store_costs"] += got["store_costs"]
    print_layouts(results)
    print(results["page_cache"])
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specjax.stores.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/specjax_store_bench", help="scratch store directory (deleted)")
    parser.add_argument("--tokens", type=int, help="tokens in the layer (default 16384; 65536 with --compare_layouts)")
    parser.add_argument("--kv_heads", type=int, help="default 4; 3 with --compare_layouts")
    parser.add_argument("--head_dim", type=int, help="default 128; 64 with --compare_layouts")
    parser.add_argument("--fraction", type=float, default=0.25, help="share of the layer's chunks read")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=32, help="preadv threads (= TensorStore file_io_concurrency)")
    parser.add_argument("--chunk_tokens", help="default 16,64,256; one value, 64, with --compare_layouts")
    parser.add_argument("--throttle_MBps", type=float, default=50.0)
    parser.add_argument("--output", help="write the results as JSON here")
    parser.add_argument("--compare_layouts", action="store_true",
                        help="compare chunk files with zarr3 sharding_indexed instead (flags below)")
    parser.add_argument("--runs", default="1,4,16", help="adjacent chunks per read")
    parser.add_argument("--shard_chunks", default="16,64", help="chunks per shard of the sharded layouts")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--index_cache_MiB", type=float, default=4.0,
                        help="cache pool of the second sharded run, warmed with the shard indexes (0: skip it)")
    args = parser.parse_args(argv)
    defaults = (dict(tokens=65536, kv_heads=3, head_dim=64, chunk_tokens="64") if args.compare_layouts
                else dict(tokens=16384, kv_heads=4, head_dim=128, chunk_tokens="16,64,256"))
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.compare_layouts and "," in args.chunk_tokens:
        parser.error("--compare_layouts takes one --chunk_tokens")
    results = run_layout_comparison(args) if args.compare_layouts else run_chunk_sizes(args)
    shutil.rmtree(args.dir, ignore_errors=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def run_chunk_sizes(args) -> dict:
    """Store reads against preadv for each chunk size, and the throttle's accuracy."""
    results = {"page_cache": PAGE_CACHE, "layer_bytes": args.tokens * args.kv_heads * args.head_dim * 4, "reads": []}
    for c in (int(x) for x in args.chunk_tokens.split(",")):
        row = bench_chunk_size(args.dir, c, args.tokens, args.kv_heads, args.head_dim, args.fraction,
                               args.repeats, args.threads)
        results["reads"].append(row)
        print(f"chunk_tokens {c:4d} ({row['chunk_bytes'] // 1024} KiB): store {row['store_ms']:8.1f} ms "
              f"{row['store_MBps']:7.1f} MB/s | preadv {row['preadv_ms']:8.1f} ms {row['preadv_MBps']:7.1f} MB/s"
              f" | store/preadv time {row['store_over_preadv_time']:.2f}")
    fp = _fill(args.dir, 64, args.tokens // 4, args.kv_heads, args.head_dim)
    results["throttle"] = bench_throttle(args.dir, fp, args.tokens // 4, args.throttle_MBps * 1e6)
    t = results["throttle"]
    print(f"throttle (emulated): set {t['setting_MBps']:.1f} MB/s, delivered {t['delivered_MBps']:.1f} MB/s, "
          f"error {100 * t['error']:.1f}%")
    print(results["page_cache"])
    return results

if __name__ == "__main__":
    sys.exit(main())
