"""`python -m specjax.stores.bench`: store chunk reads vs plain `os.preadv` on the same files, and throttle accuracy.

Both sides bypass the page cache with O_DIRECT (TensorStore `file_io_mode: direct`; `O_DIRECT` + aligned
buffers for preadv), so numbers are the disk's. The throttle line is emulated bandwidth and says so.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import os
import shutil
import sys
import time

import numpy as np

from specjax.stores.kvarray import K, PROBE
from specjax.stores.store import KVStore

ALIGN = 4096


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specjax.stores.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/specjax_store_bench", help="scratch store directory (deleted)")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens in the layer")
    parser.add_argument("--kv_heads", type=int, default=4)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--fraction", type=float, default=0.25, help="share of the layer's chunks read")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=32, help="preadv threads (= TensorStore file_io_concurrency)")
    parser.add_argument("--chunk_tokens", default="16,64,256")
    parser.add_argument("--throttle_MBps", type=float, default=50.0)
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args(argv)
    results = {"page_cache": "bypassed with O_DIRECT (TensorStore file_io_mode=direct; os.O_DIRECT for preadv)",
               "layer_bytes": args.tokens * args.kv_heads * args.head_dim * 4, "reads": []}
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
    shutil.rmtree(args.dir, ignore_errors=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
