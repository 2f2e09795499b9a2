"""Helpers the benchmark scripts share: the device's name, a dense matrix-product rate, a wall-time measurement, prefix
keys through a store's low-bit codes, a report's two files.

A script imports it with benchmarks/ on sys.path (where `python benchmarks/NAME.py` puts it; a script also loaded by
path inserts it itself).
"""

from __future__ import annotations

import json
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def device_name() -> str:
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return f"cpu ({platform.processor() or platform.machine()}, {jax.local_device_count()} device)"
    return dev.device_kind


def wall_seconds(run) -> float:
    """Seconds of one call of run()."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def matmul_tflops(size: int = 8192, repeats: int = 10) -> float:
    """The measured dense bfloat16 matrix-product rate of JAX's default device (size^3, median of `repeats`)."""
    a, b = (jax.random.normal(jax.random.key(i), (size, size), jax.numpy.bfloat16) for i in (1, 2))
    product = jax.jit(lambda x, y: x @ y)
    product(a, b).block_until_ready()
    seconds = statistics.median(wall_seconds(lambda: product(a, b).block_until_ready()) for _ in range(repeats))
    return 2 * size**3 / seconds / 1e12


def stored_keys(k, bits: int, chunk_tokens: int):
    """Prefix keys k [H, m, d] through `bits`-bit codes as a store of format 3 holds them (`kernels.quant.
    encode_key_chunks`: per channel against each `chunk_tokens`-token chunk's float16 range, chunks from position 0,
    the last one's padding left out of its range) and back: (the keys, float32 [H, m, d]; each element's code step,
    float32 [H, m, d]; the bytes the codes and their chunks' ranges take)."""
    from specjax.kernels import quant

    heads, m, d = k.shape
    padded = np.zeros((heads, -(-m // chunk_tokens) * chunk_tokens, d), np.float32)
    padded[:, :m] = np.asarray(k, np.float32)
    codes, ranges = quant.encode_key_chunks(padded, bits=bits, chunk_tokens=chunk_tokens,
                                            keys=np.arange(padded.shape[1]) < m)
    lo, hi = quant.key_ranges(jnp.asarray(ranges), head_dim=d, chunk_tokens=chunk_tokens)
    chunk = jnp.arange(m) // chunk_tokens
    keys = quant.decode_key_codes(jnp.asarray(codes[:, :m]), lo, hi, chunk, bits=bits, head_dim=d)
    step = (hi - lo)[:, chunk] / ((1 << bits) - 1)
    return np.asarray(keys), np.asarray(step), codes[:, :m].size + ranges[:, :m].size


def write_report(folder: str | None, stem: str, out: dict, text: str) -> None:
    """Print `text`; with a `folder`, write `out` as FOLDER/STEM.json and `text` as FOLDER/STEM.md."""
    print(text)
    if folder:
        path = pathlib.Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        (path / f"{stem}.json").write_text(json.dumps(out, indent=1))
        (path / f"{stem}.md").write_text(text)
