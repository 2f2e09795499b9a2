"""Helpers the benchmark scripts share: the device's name, a dense matrix-product rate, a wall-time measurement.

A script imports it with benchmarks/ on sys.path (where `python benchmarks/NAME.py` puts it; a script also loaded by
path inserts it itself).
"""

from __future__ import annotations

import platform
import statistics
import time

import jax


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
