"""Data path: the engine's achieved KV read rate against raw O_DIRECT reads of the very same chunk files.

    python benchmarks/data_path.py --task needle --limit 16 --output /tmp/data_path.json

One run, one store. The engine side is `as_full` with both caches off and O_DIRECT reads (`--gpu_cache 0
--cpu_cache 0 --direct_io` in `python -m specjax.eval` terms), driven by the evaluation's own runner
(`runner.run_all`: base store written once, a private copy opened, the warm-up and compile passes run untimed, so
no timed request pays for a first JIT compile). Its rate is sum(disk_bytes) / sum(probe_io + kv_io_stall) over the
timed requests, from each request's `io` and `breakdown_ms`.

The raw side reads, for each request, exactly the chunks the engine read (logged by wrapping the store's
`read_chunks`: layer, kind, chunk, in the order the engine asked for them) with a plain thread pool of as many
threads as TensorStore's `file_io_concurrency`: open with O_DIRECT, one `os.preadv` into a page-aligned buffer,
close (`specjax.stores.bench.read_direct`). Its rate is bytes / wall time of those reads.

Both sides bypass the page cache with O_DIRECT (the page cache is not dropped; that would need root and would not
stop a VM host's cache either). The two alternate: on every other request the raw reads come first (with the
chunks the previous request on the same prefix read, checked against what the engine then reads), so neither
side systematically profits from the other warming the disk.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import pathlib
import shlex
import sys
import tempfile
import time

import numpy as np

from specjax.eval import __main__ as eval_main
from specjax.eval import runner, systems as systems_lib, tasks as tasks_lib, workload as workload_lib
from specjax.eval.fallback_tokenizer import tokenizer_for
from specjax.eval.partial import code_version
from specjax.stores import Layout, bench
from specjax.stores.bench import chunk_path, read_direct

IO_KEYS = ("disk_bytes", "chunks_read", "read_requests", "host_to_device_transfers", "host_to_device_bytes")
PAGE_CACHE = (f"{bench.PAGE_CACHE}, on both sides; the page cache is not dropped (needs root); a VM host may still "
              "cache the virtual disk")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python benchmarks/data_path.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="registered model name or converted directory")
    p.add_argument("--init", default="pretrained", choices=["pretrained", "random"])
    p.add_argument("--dtype", default=None, help="model dtype (default: the model's own)")
    p.add_argument("--task", default="needle")
    p.add_argument("--data_dir", default=None, help="task files laid out like ../shared/data")
    p.add_argument("--limit", type=int, default=16, help="timed requests (the first N task items)")
    p.add_argument("--prefix_tokens", type=int, default=None, help="extend every prefix to this many tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--system", default="as_full", help="engine system (as_full reads every prefix chunk)")
    p.add_argument("--chunk_tokens", type=int, default=Layout.chunk_tokens)
    p.add_argument("--threads", type=int, default=32,
                   help="raw reader threads (= file_io_concurrency of specjax.stores.kvarray.make_context)")
    p.add_argument("--store", default=None, help="scratch directory for the stores (default: a temporary one)")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def build_workload(model, args) -> workload_lib.Workload:
    """The request sequence `python -m specjax.eval` builds for the same flags."""
    task = tasks_lib.load_task(args.task, args.data_dir)
    spec = workload_lib.WorkloadSpec(prefix_tokens=args.prefix_tokens, limit=args.limit, seed=args.seed)
    return workload_lib.build_workload(task, tokenizer_for(model)[0], spec)


@dataclasses.dataclass
class RawRead:
    seconds: float
    nbytes: int
    files: int


class MeasuredSystem:
    """An eval system whose every request is followed (or preceded) by raw reads of the chunks it read."""

    def __init__(self, inner, pool: concurrent.futures.Executor):
        self.inner, self.pool = inner, pool
        self.records: list[dict] = []  # one per run() call: warm-up passes excluded, compile pass included
        self.patterns: dict[tuple, list] = {}  # prefix -> (layer, kind, chunk) its last engine request read
        self._log: list = []
        self._last = None  # (engine result, chunks read) of the last engine request

    def __getattr__(self, name):  # populate, warm, close, needs_store, store_key, ...
        return getattr(self.inner, name)

    def open(self, store_path: str) -> None:
        self.inner.open(store_path)
        self.store_path = store_path
        store, engine = self.inner.store, self.inner.engine
        read_chunks, engine_run = store.read_chunks, engine.run

        def logged_read_chunks(layer, kind, chunks, **kwargs):
            reads = read_chunks(layer, kind, chunks, **kwargs)
            self._log.extend(reads)
            return reads

        def logged_run(request):
            self._log = []
            result = engine_run(request)
            chunks = landed(self._log)
            self.patterns[tuple(request.prefix)] = chunks
            self._last = result, chunks
            return result

        store.read_chunks, engine.run = logged_read_chunks, logged_run  # this run's instances only

    def read_raw(self, chunks: list) -> RawRead:
        lay = self.inner.store.layout
        paths = [chunk_path(self.store_path, chunk, layer, kind) for layer, kind, chunk in chunks]
        start = time.perf_counter()
        nbytes = read_direct(self.pool, paths, max(lay.chunk_nbytes(k) for k in lay.kinds()))
        return RawRead(time.perf_counter() - start, nbytes, len(paths))

    def run(self, request):
        planned = self.patterns.get(tuple(request.prefix_ids))
        raw_first = len(self.records) % 2 == 1 and planned is not None
        raw = self.read_raw(planned) if raw_first else None
        outcome = self.inner.run(request)
        result, chunks = self._last
        if not raw_first or chunks != planned:
            raw, raw_first = self.read_raw(chunks), False
        self.records.append(request_record(request, result, raw, raw_first,
                                           self.inner.store.scheduler.rate_bytes_per_s()))
        return outcome


def landed(reads) -> list[tuple[int, int, int]]:
    """(layer, kind, chunk) of every chunk read whose disk read delivered (what disk_bytes counts), in order."""
    concurrent.futures.wait([r.run.read.future for r in reads])
    return [(r.layer, r.kind, r.chunk) for r in reads
            if not r.run.read.future.cancelled() and r.run.read.future.exception() is None]


def request_record(request, result, raw: RawRead, raw_first: bool, scheduler_rate) -> dict:
    io_ms = result.breakdown_ms["probe_io"] + result.breakdown_ms["kv_io_stall"]
    disk_bytes = result.io["disk_bytes"]
    return {"request_id": request.request_id, "prefix_tokens": len(request.prefix_ids),
            **{k: result.io[k] for k in IO_KEYS},
            "ttft_ms": result.ttft_ms, **{f"{k}_ms": v for k, v in result.breakdown_ms.items()},
            "engine_io_ms": io_ms, "engine_MBps": disk_bytes / io_ms / 1e3 if io_ms else None,
            "scheduler_MBps": scheduler_rate / 1e6 if scheduler_rate else None,
            "raw_bytes": raw.nbytes, "raw_files": raw.files, "raw_ms": raw.seconds * 1e3,
            "raw_MBps": raw.nbytes / raw.seconds / 1e6, "raw_first": raw_first}


@contextlib.contextmanager
def measured_systems(pool, made: list):
    """The runner's systems come wrapped in MeasuredSystem (appended to `made`) while this is open."""
    make = systems_lib.make_system

    def make_measured(name, model, settings):
        made.append(MeasuredSystem(make(name, model, settings), pool))
        return made[-1]

    systems_lib.make_system = make_measured
    try:
        yield
    finally:
        systems_lib.make_system = make


def summarize(records: list[dict]) -> dict:
    disk = sum(r["disk_bytes"] for r in records)
    io_s = sum(r["engine_io_ms"] for r in records) / 1e3
    raw_bytes = sum(r["raw_bytes"] for r in records)
    raw_s = sum(r["raw_ms"] for r in records) / 1e3
    engine, raw = disk / io_s / 1e6, raw_bytes / raw_s / 1e6
    keys = [k for k in records[0] if k not in ("request_id", "raw_first") and records[0][k] is not None]
    medians = {k: float(np.median([r[k] for r in records if r[k] is not None])) for k in keys}
    return {"engine_MBps": engine, "raw_MBps": raw, "ratio_engine_over_raw": engine / raw,
            "engine_bytes": disk, "engine_io_s": io_s, "raw_bytes": raw_bytes, "raw_s": raw_s,
            "requests": len(records), "raw_first_requests": sum(r["raw_first"] for r in records),
            "medians": medians}


def cpu_description() -> str:
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return f"{os.cpu_count()} cores"


def filesystem_of(path: str) -> str:
    """The mount (device, mount point, type) holding `path`, from /proc/mounts."""
    path, best = os.path.realpath(path), ("?", "", "?")
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/mounts").read_text().splitlines():
            device, mount, fstype = line.split()[:3]
            if (path + "/").startswith(mount.rstrip("/") + "/") and len(mount) >= len(best[1]):
                best = (device, mount, fstype)
    return f"{best[0]} on {best[1]} ({best[2]})"


def measure(model, workload, args, store_dir: pathlib.Path) -> tuple[list[dict], runner.Run]:
    """The runner's as_full run with every request's raw reads beside it; the timed requests' records."""
    settings = systems_lib.SystemSettings(chunk_tokens=args.chunk_tokens, gpu_cache_bytes=0, cpu_cache_bytes=0,
                                          direct_io=True, seed=args.seed)
    made: list[MeasuredSystem] = []
    with concurrent.futures.ThreadPoolExecutor(args.threads) as pool, measured_systems(pool, made):
        (run,) = runner.run_all(model, workload, runner.plan([args.system], [settings.retention]), settings,
                                store_dir)
    records = made[0].records[-len(workload.requests):]  # before them: the untimed compile pass
    assert [r["request_id"] for r in records] == [r.request_id for r in workload.requests]
    return records, run


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    model = eval_main.load_model(args.model, args.dtype, args.init, args.seed)
    workload = build_workload(model, args)
    if args.store:
        pathlib.Path(args.store).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="data-path-", dir=args.store) as tmp:
        store_fs = filesystem_of(tmp)
        records, run = measure(model, workload, args, pathlib.Path(tmp))
    results = {
        **summarize(records),
        "compilations_timed": int(sum(o.counters.get("compilations", 0) for o in run.outcomes)),
        "system": args.system, "caches": "gpu 0, cpu 0", "direct_io": True, "threads": args.threads,
        "model": model.name, "weights": model.weights, "dtype": str(np.dtype(model.dtype)), "task": args.task,
        "workload": workload.summary(), "device": eval_main.device_description(), "cpu": cpu_description(),
        "store_filesystem": store_fs, "page_cache": PAGE_CACHE,
        "command": shlex.join(["python", "benchmarks/data_path.py", *argv]), "code": code_version(),
        "per_request": records,
    }
    print_summary(results)
    if args.output:
        pathlib.Path(args.output).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.output}")
    return results


def print_summary(r: dict) -> None:
    m = r["medians"]
    print(f"{r['system']} on {r['model']} ({r['weights']}), {r['task']}: {r['requests']} timed requests, "
          f"{r['compilations_timed']} compiles in them; {r['device']}; {r['cpu']}; store on {r['store_filesystem']}")
    print(f"engine: {r['engine_bytes'] / 1e6:.1f} MB in {r['engine_io_s'] * 1e3:.1f} ms of probe_io + kv_io_stall "
          f"= {r['engine_MBps']:.1f} MB/s (per request median {m['engine_MBps']:.1f})")
    print(f"raw:    {r['raw_bytes'] / 1e6:.1f} MB in {r['raw_s'] * 1e3:.1f} ms, {r['threads']} threads "
          f"= {r['raw_MBps']:.1f} MB/s (per request median {m['raw_MBps']:.1f})")
    if "scheduler_MBps" in m:
        print(f"(the engine's read scheduler measured {m['scheduler_MBps']:.1f} MB/s per request median: bytes over "
              f"time with reads in flight, not over stalls)")
    print(f"engine / raw = {r['ratio_engine_over_raw']:.3f}; per request median: {m['disk_bytes'] / 1e6:.2f} MB, "
          f"{m['chunks_read']:.0f} chunks" + "".join(f", {m[k]:.0f} {k}" for k in IO_KEYS[2:4]))
    print(r["page_cache"])


if __name__ == "__main__":
    main()
