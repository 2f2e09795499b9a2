"""Data path: each system's TTFT against the disk's own O_DIRECT rate, measured in the same run.

    python benchmarks/data_path.py --model timing-qwen2.5-7b --init random --dtype bfloat16 --task needle \
        --prefix_tokens 4096 --limit 4 --systems as_full,as_h2o_lfu,spec --output /tmp/data_path.json

One run, one store filesystem, both cache tiers off, O_DIRECT reads (`--gpu_cache 0 --cpu_cache 0 --direct_io` in
`python -m specjax.eval` terms), the systems driven by the evaluation's own runner (base store written once, a
private copy per system, warm-up and compile passes untimed).

The limit is the disk, not our layout: before the systems run, a scratch file on the store's filesystem is read with
large reads all issued at once, with O_DIRECT, twice (the engine's timed requests re-read what its warm-up read, and
this VM's disk has a cache below the guest: compare second reads with second reads); the first (cold) and second
rates are both reported, by two readers: `os.preadv` on a thread pool and TensorStore's file kvstore (the engine's
reader). The disk's rate is the best second-read rate. For each system: mean TTFT, disk bytes per request, those
bytes' time at the disk's rate, TTFT / that time, TTFT / the larger of that time and the device floor (as_full's
device work alone), TTFT / (that time + the floor + the device-side identification time), that identification time,
the host time per request that no disk read, device wait or device work overlapped (`host_exposed_ms`: see
`clock.Clock`), and the process's CPU time to the first token (`cpu_ms`, every thread's: on a CPU device the
device's compute too).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import mmap
import os
import pathlib
import shlex
import sys
import queue
import tempfile
import time

import numpy as np
import tensorstore as ts

from specjax.engine.types import EngineConfig
from specjax.eval import __main__ as eval_main
from specjax.eval import runner, systems as systems_lib, tasks as tasks_lib, workload as workload_lib
from specjax.eval.fallback_tokenizer import tokenizer_for
from specjax.eval.partial import code_version
from specjax.stores import Layout

ALIGN = 4096
PAGE_CACHE = ("bypassed with O_DIRECT on both sides (TensorStore file_io_mode=direct; os.O_DIRECT for preadv); the "
              "page cache is not dropped (needs root); a VM host may still cache the virtual disk")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python benchmarks/data_path.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="timing-qwen2.5-7b", help="registered model name or converted directory")
    p.add_argument("--init", default="random", choices=["pretrained", "random"])
    p.add_argument("--dtype", default="bfloat16", help="model dtype")
    p.add_argument("--task", default="needle")
    p.add_argument("--data_dir", default=None, help="task files laid out as docs/data.md says")
    p.add_argument("--limit", type=int, default=4, help="timed requests (the first N task items)")
    p.add_argument("--prefix_tokens", type=int, default=4096, help="extend every prefix to this many tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default="as_full,as_h2o_lfu,spec")
    p.add_argument("--retention", type=float, default=0.25)
    p.add_argument("--chunk_tokens", type=int, default=Layout.chunk_tokens)
    p.add_argument("--inflight_MiB", type=int, default=None,
                   help="the read scheduler's bound on bytes in flight (default: its own, from the measured rate)")
    p.add_argument("--disk_mb", type=int, default=256, help="size of the scratch file the disk's rate is read from")
    p.add_argument("--read_mb", type=int, default=4, help="size of one read of the disk measurement")
    p.add_argument("--threads", type=int, default=32, help="preadv threads of the disk measurement")
    p.add_argument("--store", default=None, help="scratch directory for the stores (default: a temporary one)")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def build_workload(model, args) -> workload_lib.Workload:
    """The request sequence `python -m specjax.eval` builds for the same flags."""
    task = tasks_lib.load_task(args.task, args.data_dir)
    spec = workload_lib.WorkloadSpec(prefix_tokens=args.prefix_tokens, limit=args.limit, seed=args.seed)
    return workload_lib.build_workload(task, tokenizer_for(model)[0], spec)


# -- the disk's own rate --------------------------------------------------------------------------------------


def _write_scratch(path: pathlib.Path, nbytes: int) -> None:
    chunk = np.random.default_rng(0).integers(0, 255, 8 << 20, np.uint8).tobytes()
    with open(path, "wb") as f:
        for _ in range(-(-nbytes // len(chunk))):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def _preadv_all(path: pathlib.Path, nbytes: int, read_bytes: int, threads: int) -> float:
    """Seconds to read the file with O_DIRECT `preadv`s of `read_bytes`, all queued at once on `threads`, each read
    into a page-aligned buffer faulted in beforehand (as the engine's landing buffers are: a fresh buffer would charge
    the disk with the host's page faults)."""
    offsets = range(0, nbytes, read_bytes)
    buffers: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(threads):
        buf = mmap.mmap(-1, read_bytes)  # page-aligned, as O_DIRECT requires
        buf.write(bytes(read_bytes))
        buffers.put(buf)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)

    def read(offset: int) -> int:
        buf = buffers.get()
        try:
            return os.preadv(fd, [buf], offset)
        finally:
            buffers.put(buf)

    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            start = time.perf_counter()
            got = sum(pool.map(read, offsets))
            elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
    if got != nbytes:
        raise RuntimeError(f"preadv read {got} bytes of {nbytes}")
    return elapsed


def _tensorstore_all(path: pathlib.Path, nbytes: int, read_bytes: int) -> float:
    """Seconds for TensorStore's file kvstore (O_DIRECT, the engine's context) to read the file in byte ranges of
    `read_bytes`, all issued at once."""
    from specjax.stores.kvarray import make_context

    kvs = ts.KvStore.open({"driver": "file", "path": str(path.parent) + "/"},
                          context=make_context(direct_io=True)).result()
    key = path.name.encode()
    start = time.perf_counter()
    reads = [kvs.read(key, byte_range=slice(o, min(o + read_bytes, nbytes))) for o in range(0, nbytes, read_bytes)]
    got = sum(len(r.result().value) for r in reads)
    elapsed = time.perf_counter() - start
    if got != nbytes:
        raise RuntimeError(f"TensorStore read {got} bytes of {nbytes}")
    return elapsed


def disk_rate(directory: pathlib.Path, args) -> dict:
    """The disk's O_DIRECT read rate with large reads issued at once, cold and second reads, by both readers."""
    nbytes = args.disk_mb << 20
    read_bytes = args.read_mb << 20
    out = {"file_bytes": nbytes, "read_bytes": read_bytes, "preadv_threads": args.threads}
    for reader, fn in (("preadv", lambda p: _preadv_all(p, nbytes, read_bytes, args.threads)),
                       ("tensorstore", lambda p: _tensorstore_all(p, nbytes, read_bytes))):
        path = directory / f"disk-rate-{reader}.bin"  # a file of its own: each reader's first read is cold
        _write_scratch(path, nbytes)
        try:
            seconds = [fn(path) for _ in range(3)]
        finally:
            path.unlink()
        out[reader] = {"cold_GBps": nbytes / seconds[0] / 1e9,
                       "second_GBps": [nbytes / s / 1e9 for s in seconds[1:]]}
    out["disk_GBps"] = max(r for reader in ("preadv", "tensorstore") for r in out[reader]["second_GBps"])
    return out


# -- the device's own work ------------------------------------------------------------------------------------


def device_floor_ms(model, workload, repeats: int = 3) -> float:
    """Mean over the timed requests of the device work of loading everything (as_full's layer loop with no read):
    every layer's projections, attention of the new tokens over all stored tokens and MLP, dispatched back to back
    with the prefix KV already on the device (random values of its shape), best of `repeats`. No engine runs faster
    than this from any store; on a CPU it is the host's own cores' compute, on a GPU a few ms."""
    import jax
    import jax.numpy as jnp

    from specjax.engine import steps as S
    from specjax.kernels import SharedIndices
    from specjax.models import transformer as T
    from specjax.shapes import bucket

    cfg, params = model.config, model.params
    rng = np.random.default_rng(0)
    times = []
    for request in workload.requests:
        m, n = len(request.prefix_ids), len(request.query_ids)
        shape = (cfg.num_kv_heads, bucket(m), cfg.head_dim)
        prefix_k = jnp.asarray(rng.standard_normal(shape), model.dtype)
        prefix_v = jnp.asarray(rng.standard_normal(shape), model.dtype)
        selection = SharedIndices(jnp.arange(shape[1], dtype=jnp.int32), m)
        positions = jnp.arange(m, m + bucket(n), dtype=jnp.int32)
        rotary = T.rotary_step(cfg, positions)
        ids = jnp.zeros(bucket(n), jnp.int32)

        def layers():
            h = T.embed_step(cfg, params, ids, positions)
            for lp in params["layers"]:
                q, own_k, own_v = S.project(cfg, lp, h, positions, rotary)
                h = S.finish(cfg, lp, h, q, own_k, own_v, prefix_k, prefix_v, selection, n, impl="auto")
            return jax.block_until_ready(S.head_row(cfg, params, h, n - 1))

        layers()  # compiled, not timed
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            layers()
            best = min(best, time.perf_counter() - start)
        times.append(best * 1e3)
    return float(np.mean(times))


# -- the systems ----------------------------------------------------------------------------------------------


def system_record(run, disk_Bps: float, floor_ms: float) -> dict:
    outs = run.outcomes
    mean = lambda xs: float(np.mean(xs)) if len(xs) else 0.0  # noqa: E731
    disk_bytes = mean([o.counters.get("disk_bytes", 0.0) for o in outs])
    ttft = mean([o.ttft_ms for o in outs])
    bytes_ms = disk_bytes / disk_Bps * 1e3
    identify = mean([o.breakdown_ms.get("identify", 0.0) for o in outs])
    exposed = [o.counters["host_exposed_ms"] for o in outs if "host_exposed_ms" in o.counters]
    cpu = [o.counters["cpu_ms"] for o in outs if "cpu_ms" in o.counters]
    return {
        "ttft_ms": ttft, "ttft_ms_per_request": [o.ttft_ms for o in outs],
        "breakdown_ms": {k: mean([o.breakdown_ms.get(k, 0.0) for o in outs])
                         for k in ("probe_io", "identify", "kv_io_stall", "compute")},
        "disk_bytes": disk_bytes, "reads": mean([o.counters.get("read_requests", 0.0) for o in outs]),
        "host_to_device_transfers": mean([o.counters.get("host_to_device_transfers", 0.0) for o in outs]),
        "bytes_ms": bytes_ms, "ttft_over_bytes_ms": ttft / bytes_ms if bytes_ms else None,
        "ttft_over_bound_ms": ttft / max(bytes_ms, floor_ms) if max(bytes_ms, floor_ms) else None,
        "device_identify_ms": identify,
        "ttft_over_bytes_plus_identify_ms": ttft / (bytes_ms + identify) if bytes_ms else None,
        # issue 38's bar for the systems that identify: TTFT against their bytes' time plus their device compute,
        # taken as the floor (as_full's device work) plus the identification's device time; the clock's identify
        # time also counts device work queued before a step (`layer_io.Clock.device_work`), so this denominator
        # errs high and the ratio low: a ratio above 1.3 misses the bar for certain
        "ttft_over_bytes_plus_device_ms": (ttft / (bytes_ms + floor_ms + identify)
                                           if bytes_ms + floor_ms + identify else None),
        "host_exposed_ms": mean(exposed) if exposed else None,
        "host_exposed_share_of_ttft": mean(exposed) / ttft if exposed and ttft else None,
        "cpu_ms": mean(cpu) if cpu else None,  # the process's CPU time to the first token, every thread's
        "compilations_timed": int(sum(o.counters.get("compilations", 0) for o in outs)),
    }


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


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    model = eval_main.load_model(args.model, args.dtype, args.init, args.seed)
    workload = build_workload(model, args)
    names = [s for s in args.systems.split(",") if s]
    settings = systems_lib.SystemSettings(EngineConfig(retention=args.retention), chunk_tokens=args.chunk_tokens,
                                          direct_io=True, seed=args.seed,
                                          inflight_bytes=None if args.inflight_MiB is None else args.inflight_MiB << 20)
    if args.store:
        pathlib.Path(args.store).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="data-path-", dir=args.store) as tmp:
        store_fs = filesystem_of(tmp)
        disk = disk_rate(pathlib.Path(tmp), args)
        print(f"disk: {disk['disk_GBps']:.2f} GB/s (O_DIRECT second reads of {args.read_mb} MiB, all at once)",
              flush=True)
        floor = device_floor_ms(model, workload)
        print(f"device floor (as_full's device work alone, KV on the device): {floor:.1f} ms", flush=True)
        runs = runner.run_all(model, workload, runner.plan(names, [args.retention]), settings, pathlib.Path(tmp))
    results = {
        "disk": disk,
        "device_floor_ms": floor,
        "systems": {run.key: system_record(run, disk["disk_GBps"] * 1e9, floor) for run in runs},
        "caches": "gpu 0, cpu 0", "direct_io": True, "retention": args.retention, "inflight_MiB": args.inflight_MiB,
        "model": model.name, "weights": model.weights, "dtype": str(np.dtype(model.dtype)), "task": args.task,
        "timing_shape": _timing_shape(model.name),
        "workload": workload.summary(), "device": eval_main.device_description(), "cpu": cpu_description(),
        "store_filesystem": store_fs, "page_cache": PAGE_CACHE,
        "command": shlex.join(["python", "benchmarks/data_path.py", *argv]), "code": code_version(),
    }
    print_summary(results)
    if args.output:
        pathlib.Path(args.output).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.output}")
    return results


def _timing_shape(name: str) -> str | None:
    from specjax.configs.models import TIMING_SHAPES

    real = TIMING_SHAPES.get(name)
    return f"{name}: {real}'s KV geometry with almost no compute (random weights)" if real else None


def print_summary(r: dict) -> None:
    d = r["disk"]
    print(f"{r['model']} ({r['weights']}, {r['dtype']}), {r['task']}; {r['device']}; {r['cpu']}; "
          f"store on {r['store_filesystem']}")
    if r["timing_shape"]:
        print(f"timing shape: {r['timing_shape']}")
    for reader in ("preadv", "tensorstore"):
        print(f"disk, {reader}: cold {d[reader]['cold_GBps']:.2f} GB/s, second reads "
              + ", ".join(f"{x:.2f}" for x in d[reader]["second_GBps"]) + " GB/s")
    print(f"disk rate used: {d['disk_GBps']:.2f} GB/s; device floor {r['device_floor_ms']:.1f} ms")
    print(f"{'system':<16}{'TTFT ms':>10}{'MB/req':>9}{'bytes ms':>10}{'TTFT/bytes':>11}{'TTFT/bound':>11}"
          f"{'TTFT/(bytes+dev)':>17}{'identify':>10}{'host exp.':>11}{'CPU ms':>9}{'reads':>8}{'h2d':>6}")
    for key, s in r["systems"].items():
        def shown(field: str, spec: str) -> str:  # "-" for a figure the run could not give
            return "-" if s.get(field) is None else format(s[field], spec)

        print(f"{key:<16}{s['ttft_ms']:>10.1f}{s['disk_bytes'] / 1e6:>9.1f}{s['bytes_ms']:>10.1f}"
              f"{shown('ttft_over_bytes_ms', '.2f'):>11}{shown('ttft_over_bound_ms', '.2f'):>11}"
              f"{shown('ttft_over_bytes_plus_device_ms', '.2f'):>17}{s['device_identify_ms']:>10.1f}"
              f"{shown('host_exposed_ms', '.1f'):>11}{shown('cpu_ms', '.0f'):>9}{s['reads']:>8.0f}"
              f"{s['host_to_device_transfers']:>6.0f}")
    print(r["page_cache"])


if __name__ == "__main__":
    main()
