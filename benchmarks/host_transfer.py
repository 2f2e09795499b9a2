"""Host -> device rates side by side in one run: the copies a take's host rows make, against the link's limit.

    python benchmarks/host_transfer.py --output results/gpu/host_transfer.json     # on the GPU machine
    python benchmarks/host_transfer.py --tiny                                      # a check in seconds on a CPU

- `pageable`: `jax.device_put` of a landing buffer (`stores.landing`) of pageable memory ($SPECJAX_DMA_MAP=off);
- `dma_mapped`: the same buffer kind registered for DMA with the accelerator's runtime (the default there);
- `pinned_host`: an array in JAX's `pinned_host` memory kind copied to device memory: the link's rate from memory
  the runtime allocated page-locked itself (what production CPU-offload paths use);
- `host_tier_take`: the host-tier hits of one layer, as a take moves them: the selected rows copied out of the host
  tier's pages (`stores.pool.HostPages`) into a landing buffer, that buffer crossing, the device's gather
  (`DevicePool.gather`), blocked until the rows are on the device; rate = the rows' bytes / that time, with each
  buffer kind; and `pages_*`: the hit chunks' whole pages crossing as they lie (one copy of the page array's
  range, no row copy on the host, pageable or registered for DMA), the device then gathering the rows
  (`DevicePool.gather_extent`). Shape: Qwen2.5-7B's K or V of one layer (4 KV heads of 128, bfloat16) over
  `--tokens` tokens, the rows `--retention` of them, chosen at random.

Each figure is the median of `--repeats` timed copies after one untimed. On a CPU device there is no DMA
registration or pinned memory kind distinct from the host: those rows say so.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _common import device_name, wall_seconds  # noqa: E402
from specjax.stores.kvarray import Layout  # noqa: E402
from specjax.stores.landing import LandingBuffers  # noqa: E402
from specjax.stores.pool import DevicePool, HostPages, copy_rows, staging  # noqa: E402


def _median_seconds(fn, repeats: int) -> float:
    fn()  # untimed: sets up the path (and compiles the gather)
    return statistics.median(wall_seconds(fn) for _ in range(repeats))


def buffer_rates(nbytes: int, repeats: int) -> dict:
    """GB/s of `jax.device_put` of a landing buffer, pageable and registered for DMA, and of a pinned_host array."""
    device = jax.devices()[0]
    out = {"bytes": nbytes}
    for kind in ("off", "on"):
        buffers = LandingBuffers()
        name = "pageable" if kind == "off" else "dma_mapped"
        if buffers.enable_dma(kind) != (kind == "on"):
            out[name] = None  # no runtime here registers host memory (a CPU device reads it in place)
            continue
        host = buffers.empty((nbytes,), np.uint8)
        host[:] = 1
        out[name] = nbytes / _median_seconds(lambda: jax.device_put(host, device).block_until_ready(), repeats) / 1e9
        del host
        buffers.close()
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" in kinds and device.platform != "cpu":
        pinned = jax.device_put(np.ones(nbytes, np.uint8),
                                jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host"))
        on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
        out["pinned_host"] = nbytes / _median_seconds(
            lambda: jax.device_put(pinned, on_device).block_until_ready(), repeats) / 1e9
    else:
        out["pinned_host"] = None
    return out


def host_tier_take(tokens: int, retention: float, repeats: int, seed: int = 0) -> dict:
    """GB/s of one layer's host-tier hits crossing as a take moves them, with each landing buffer kind."""
    layout = Layout(num_layers=1, kv_heads=4, head_dim=128, probe_heads=4, chunk_tokens=64, dtype="bfloat16")
    kind, c = 0, layout.chunk_tokens
    n_chunks = -(-tokens // c)
    pages = HostPages(layout, n_chunks * layout.chunk_nbytes(kind))
    rng = np.random.default_rng(seed)
    chunk = np.zeros((layout.heads(kind), c, layout.head_dim), layout.np_dtype)
    for i in range(n_chunks):
        chunk[...] = rng.standard_normal(chunk.shape).astype(layout.np_dtype)
        pages.placed((0, kind, i), chunk)
    slot_of = pages.slots([(0, kind, i) for i in range(n_chunks)])
    rows = np.sort(rng.choice(n_chunks * c, size=max(16, int(retention * n_chunks * c)), replace=False))
    size = -(-len(rows) // 16) * 16
    index, offsets = slot_of[rows // c], (rows % c).astype(np.int64)
    pool = DevicePool(layout, 0)  # no device tier: every row crosses from the host
    rows_nbytes = len(rows) * layout.token_nbytes(kind)
    expected = np.swapaxes(pages.array(kind)[index, :, offsets], 0, 1)  # [heads, rows, d]: what every path must move

    def check(on_device, path):
        got = np.asarray(on_device)[:, :len(rows)]
        if not np.array_equal(got.view(np.uint16), expected.view(np.uint16)):
            raise AssertionError(f"{path}: the rows on the device are not the host tier's")
    out = {"tokens": n_chunks * c, "rows": int(len(rows)), "bytes": rows_nbytes}
    for name, choice in (("pageable", "off"), ("dma_mapped", "on")):
        buffers = LandingBuffers()
        if buffers.enable_dma(choice) != (choice == "on"):
            out[name] = None
            continue

        def take():  # as `Prefetcher._gather_parts` moves host rows
            staged = staging((layout.heads(kind), size, layout.head_dim), layout.np_dtype, len(rows), buffers)
            copy_rows(staged, np.arange(len(rows)), pages.array(kind), index, offsets)
            slots = np.full(size, -1, np.int64)
            return pool.gather(kind, slots, np.pad(offsets, (0, size - len(rows))), staged).block_until_ready()

        check(take(), name)
        copy_only = _median_seconds(lambda: copy_rows(  # the host's part alone: the rows' copy into the buffer
            buffers.empty((layout.heads(kind), size, layout.head_dim), layout.np_dtype), np.arange(len(rows)),
            pages.array(kind), index, offsets), repeats)
        out[name] = {"GBps": rows_nbytes / _median_seconds(take, repeats) / 1e9,
                     "host_copy_GBps": rows_nbytes / copy_only / 1e9}
        buffers.close()
    table = np.full((2, size), -1, np.int32)
    table[0, :len(rows)], table[1, :len(rows)] = index, offsets
    whole = pages.array(kind)[:n_chunks]  # the hit chunks' slots, one run
    client = jax.devices()[0].client
    for name in ("pages_pageable", "pages_dma_mapped"):
        if name == "pages_dma_mapped":
            if jax.default_backend() == "cpu" or not hasattr(client, "dma_map"):
                out[name] = None
                continue
            client.dma_map(whole.ctypes.data, whole.nbytes)
        try:
            check(pool.gather_extent(kind, whole, table), name)
            seconds = _median_seconds(lambda: pool.gather_extent(kind, whole, table).block_until_ready(), repeats)
        finally:
            if name == "pages_dma_mapped":
                client.dma_unmap(whole.ctypes.data)
        out[name] = {"GBps": rows_nbytes / seconds / 1e9, "pages_GBps": whole.nbytes / seconds / 1e9,
                     "pages_bytes": whole.nbytes}
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python benchmarks/host_transfer.py", description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256, help="bytes of one buffer copy, MiB")
    p.add_argument("--tokens", type=int, default=16384, help="tokens of the host-tier layer")
    p.add_argument("--retention", type=float, default=0.25, help="share of the layer's rows a take moves")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="small sizes (16 MiB, 1,024 tokens): a check, not a measure")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.tiny:
        args.mb, args.tokens, args.repeats = 16, 1024, 2
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = {"device": device_name(), "jax": jax.__version__, "backend": jax.default_backend(), "tiny": args.tiny,
              "buffer_GBps": buffer_rates(args.mb << 20, args.repeats),
              "host_tier_take": host_tier_take(args.tokens, args.retention, args.repeats),
              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    b, t = result["buffer_GBps"], result["host_tier_take"]
    print(f"{result['device']}: device_put of {args.mb} MiB, GB/s: pageable {fmt(b['pageable'])}, "
          f"dma_mapped {fmt(b['dma_mapped'])}, pinned_host {fmt(b['pinned_host'])}")
    for name in ("pageable", "dma_mapped", "pages_pageable", "pages_dma_mapped"):
        v = t[name]
        detail = "" if v is None else (
            f" (the host's row copy alone {v['host_copy_GBps']:.2f})" if "host_copy_GBps" in v
            else f" (pages {v['pages_GBps']:.2f} GB/s of {v['pages_bytes'] / 1e6:.1f} MB)")
        print(f"host-tier take, {t['rows']} of {t['tokens']} rows ({t['bytes'] / 1e6:.1f} MB), {name}: "
              + ("n/a" if v is None else f"{v['GBps']:.2f} GB/s of rows{detail}"))
    if args.output:
        pathlib.Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
