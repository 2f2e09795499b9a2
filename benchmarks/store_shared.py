"""`python benchmarks/store_shared.py`: commit latency of one store shared by 1..N processes.

Each process inserts `--commits` small prefixes of its own (chunks written and durable first) and times
`commit()` alone: adopting others' generations, merging, publishing. Protocols compared on the local disk:
`dir` (a local directory: flock + fsync + rename, the default for paths), `kvstore` (the same directory through
TensorStore's file kvstore: conditional writes, retried on conflict, as on an object store) and `ocdbt`
(`file://DIR|ocdbt`: the whole store inside a TensorStore OCDBT database, conditional writes through it).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time

import numpy as np

FP = {"arch": "bench-shared", "num_layers": 4, "kv_heads": 2, "head_dim": 16, "probe_heads": 0, "chunk_tokens": 16}


def _location(protocol: str, directory: str):
    return f"file://{directory}|ocdbt" if protocol == "ocdbt" else directory


def _worker(protocol: str, directory: str, writer: int, commits: int, go, out) -> None:
    from specjax.stores import KVStore, manifest

    if protocol == "kvstore":  # the object-store path (conditional writes) on the same local directory
        init = manifest.ManifestIO.__init__

        def as_kvstore(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.local_dir = None

        manifest.ManifestIO.__init__ = as_kvstore
    rng = np.random.default_rng(writer)
    store = KVStore.open(_location(protocol, directory), FP)
    kv = [(rng.standard_normal((2, 32, 16)).astype(np.float32),) * 2 for _ in range(FP["num_layers"])]
    go.wait()
    times = []
    for i in range(commits):
        tokens = [1_000_000 + 1000 * writer + i] + rng.integers(0, 1000, 31).tolist()
        w = store.begin_insert(tokens)
        for layer, (k, v) in enumerate(kv):
            w.write_layer(layer, k, v)
        w.wait_durable()
        start = time.perf_counter()
        w.commit()
        times.append(time.perf_counter() - start)
    stats = store.stats()
    store.close()
    out.put((times, stats["commit_conflicts"]))


def run(protocol: str, procs: int, commits: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        directory = os.path.join(tmp, "store")
        from specjax.stores import KVStore

        KVStore.open(_location(protocol, directory), FP).close()
        go, out = ctx.Event(), ctx.Queue()
        workers = [ctx.Process(target=_worker, args=(protocol, directory, w, commits, go, out)) for w in range(procs)]
        for p in workers:
            p.start()
        time.sleep(3.0)  # every worker has opened the store
        start = time.perf_counter()
        go.set()
        results = [out.get() for _ in workers]
        wall = time.perf_counter() - start
        for p in workers:
            p.join()
        with KVStore.open(_location(protocol, directory), FP) as store:
            nodes = store.stats()["nodes"]
    times = [t for r, _ in results for t in r]
    return {"protocol": protocol, "procs": procs, "commits": len(times), "stored": nodes,
            "median_ms": 1e3 * statistics.median(times), "p90_ms": 1e3 * np.percentile(times, 90),
            "commits_per_s": len(times) / wall, "conflicts": sum(c for _, c in results)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/store_shared.py", description=__doc__.splitlines()[0])
    parser.add_argument("--protocols", default="dir,kvstore,ocdbt")
    parser.add_argument("--procs", default="1,4")
    parser.add_argument("--commits", type=int, default=50)
    args = parser.parse_args(argv)
    print("| protocol | processes | commits | stored | median ms | p90 ms | commits/s | conflicts |")
    print("|---|---|---|---|---|---|---|---|")
    for protocol in args.protocols.split(","):
        for procs in (int(p) for p in args.procs.split(",")):
            try:
                r = run(protocol, procs, args.commits)
            except Exception as e:  # noqa: BLE001 -- one protocol failing still reports the others
                print(f"| {protocol} | {procs} | failed: {type(e).__name__}: {str(e)[:120]} |")
                continue
            print(f"| {r['protocol']} | {r['procs']} | {r['commits']} | {r['stored']} | {r['median_ms']:.1f} | "
                  f"{r['p90_ms']:.1f} | {r['commits_per_s']:.0f} | {r['conflicts']} |", flush=True)


if __name__ == "__main__":
    main()
