"""The machine's limits, measured in one short run: the disk's O_DIRECT read rate, host-to-device copies, a bf16
matrix product. Every ratio a GPU session reports is against these (issue 40).

    python benchmarks/machine_limits.py --store /tmp/scratch --output results/gpu/limits.json
    python benchmarks/machine_limits.py --tiny            # small sizes: checks the script in seconds on a CPU

- disk: `benchmarks/data_path.py`'s measurement (a scratch file on --store's filesystem read with O_DIRECT `preadv`s
  and TensorStore, all reads issued at once; a cold first read, then second reads; the best second read is the rate).
- host to device: `jax.device_put` of pageable host memory (numpy), and of the same bytes from memory already
  faulted in, median of repeats.
- matmul: bf16 [n, n] @ [n, n] on JAX's default device (`benchmarks/_common.py`'s `matmul_tflops`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import data_path  # noqa: E402  (benchmarks/data_path.py: the disk measurement)
from _common import device_name, matmul_tflops  # noqa: E402


def host_to_device_GBps(nbytes: int, repeats: int) -> dict:
    """`jax.device_put` of `nbytes` of host memory, blocked until it is on the device: the median rate of
    `repeats` copies of one array (its pages faulted in by the first), and of fresh arrays (numpy's new memory)."""
    device = jax.devices()[0]
    host = np.ones(nbytes, np.uint8)

    def seconds(array) -> float:
        start = time.perf_counter()
        jax.device_put(array, device).block_until_ready()
        return time.perf_counter() - start

    seconds(host)  # compiles nothing, but sets up the transfer path
    reused = statistics.median(seconds(host) for _ in range(repeats))
    fresh = statistics.median(seconds(np.ones(nbytes, np.uint8)) for _ in range(repeats))
    return {"bytes": nbytes, "repeats": repeats, "same_array_GBps": nbytes / reused / 1e9,
            "fresh_array_GBps": nbytes / fresh / 1e9}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python benchmarks/machine_limits.py", description=__doc__.splitlines()[0])
    p.add_argument("--store", default=None, help="a folder on the filesystem the stores use (default: a temp dir)")
    p.add_argument("--disk_mb", type=int, default=1024, help="scratch file size of the disk measurement")
    p.add_argument("--read_mb", type=int, default=4, help="size of one read")
    p.add_argument("--threads", type=int, default=32, help="preadv threads")
    p.add_argument("--h2d_mb", type=int, default=1024, help="bytes of one host-to-device copy")
    p.add_argument("--matmul", type=int, default=8192, help="n of the bf16 n x n matrix product")
    p.add_argument("--tiny", action="store_true", help="small sizes (64 MB, 64 MB, n=512): a check, not a measure")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.tiny:
        args.disk_mb, args.h2d_mb, args.matmul = 64, 64, 512
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.store) as scratch:
        disk = data_path.disk_rate(pathlib.Path(scratch), args)
    result = {
        "device": device_name(), "jax": jax.__version__, "backend": jax.default_backend(), "tiny": args.tiny,
        "filesystem": data_path.filesystem_of(args.store or tempfile.gettempdir()),
        "cpu": data_path.cpu_description(), "disk": disk, "page_cache": data_path.PAGE_CACHE,
        "host_to_device": host_to_device_GBps(args.h2d_mb << 20, repeats=5),
        "matmul_bf16_tflops": matmul_tflops(args.matmul, repeats=5), "matmul_n": args.matmul,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    h2d = result["host_to_device"]
    print(f"{result['device']}: disk {disk['disk_GBps']:.2f} GB/s (O_DIRECT second reads, {args.read_mb} MiB, "
          f"cold preadv {disk['preadv']['cold_GBps']:.2f}); host->device {h2d['same_array_GBps']:.1f} GB/s "
          f"(fresh memory {h2d['fresh_array_GBps']:.1f}); bf16 matmul {result['matmul_bf16_tflops']:.3g} TFLOP/s")
    if args.output:
        pathlib.Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
