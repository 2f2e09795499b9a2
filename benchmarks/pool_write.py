"""The device pool's page write, side by side: a scatter of 64 pages into a page array in the store's dtype (what the
pool did before) and into the same bits as unsigned integers (what `stores.pool` does), on JAX's default device.

    python benchmarks/pool_write.py                      # Qwen2.5-7B's KV pages (4 heads x 64 tokens x 128), 92 MB
    python benchmarks/pool_write.py --dtype float16 --slots 400

XLA:CPU scatters bfloat16 by converting the whole operand, so the write's time grows with the pool, not with the
pages written; the bits scatter in place. Each write is donated and blocked on; the median of --repeats.
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

from _common import device_name  # noqa: E402  (benchmarks/_common.py)
from specjax.stores.kvarray import Layout  # noqa: E402
# the pool's own write step, on either element type
from specjax.stores.pool import page_dtype, write_pages  # noqa: E402


def write_ms(pages: jax.Array, slots: np.ndarray, data: jax.Array, repeats: int) -> tuple[float, jax.Array]:
    pages = write_pages(pages, slots, data).block_until_ready()  # compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        pages = write_pages(pages, slots, data).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, pages


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python benchmarks/pool_write.py", description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--slots", type=int, default=1400, help="pages in the page array")
    p.add_argument("--pages", type=int, default=64, help="pages one write moves (stores.pool.MAX_WRITE_PAGES)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--chunk_tokens", type=int, default=64)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    dtype = Layout(num_layers=1, kv_heads=1, head_dim=1, probe_heads=0, dtype=args.dtype).np_dtype
    shape = (args.heads, args.chunk_tokens, args.head_dim)
    rng = np.random.default_rng(0)
    slots = np.sort(rng.choice(args.slots, args.pages, replace=False)).astype(np.int32)
    values = rng.standard_normal((args.pages, *shape)).astype(dtype)
    out = {"device": device_name(), "jax": jax.__version__, "dtype": args.dtype, "pool_bytes": 0,
           "pages_written": args.pages, "repeats": args.repeats}
    for name, as_type in (("store_dtype", dtype), ("bits", page_dtype(dtype))):
        pages = jax.device_put(np.zeros((args.slots + 1, *shape), as_type))
        out["pool_bytes"] = pages.nbytes
        ms, pages = write_ms(pages, slots, jax.device_put(values.view(as_type)), args.repeats)
        bits = page_dtype(dtype)
        assert np.array_equal(np.asarray(pages[slots]).view(dtype).view(bits), values.view(bits))
        out[f"{name}_ms"] = ms
    print(f"{out['device']}: {args.pages} pages into a {out['pool_bytes'] / 1e6:.0f} MB pool of {args.dtype}: "
          f"{out['store_dtype_ms']:.2f} ms as {args.dtype}, {out['bits_ms']:.2f} ms as its bits")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
