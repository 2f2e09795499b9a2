"""The checks quoted in the README, as run (with `.venv/bin/python`, from the repository root): a zero-copy
`jax.device_put` of a 4 MiB landing buffer alone, beside a busy Python thread, and while a jitted matmul runs on the
CPU device; and how fast a new landing buffer is faulted in."""
import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax.stores.landing import BUFFERS, LandingBuffers

b = BUFFERS.empty((65, 4, 64, 128), ml_dtypes.bfloat16)
b[:] = 1
x = jax.device_put(b)
x.block_until_ready()
print("zero-copy:", x.unsafe_buffer_pointer() == b.ctypes.data)


def per_put(n=50):
    t = time.perf_counter()
    for _ in range(n):
        jax.device_put(b)
    return (time.perf_counter() - t) / n * 1e3


print("device_put alone ms", per_put())
stop = False


def busy():
    while not stop:
        sum(range(1000))


th = threading.Thread(target=busy)
th.start()
print("device_put beside a busy Python thread ms", per_put())
stop = True
th.join()
a = jnp.ones((2048, 2048), jnp.float32)
f = jax.jit(lambda a: (a @ a) @ a)
f(a).block_until_ready()
for _ in range(3):
    y = f(a)
    t = time.perf_counter()
    jax.device_put(b)
    print("device_put while a matmul runs ms", (time.perf_counter() - t) * 1e3)
    y.block_until_ready()
fresh = LandingBuffers()
for mb in (4, 64, 256):
    t = time.perf_counter()
    fresh.empty((mb << 20,), np.uint8)
    dt = time.perf_counter() - t
    print(f"new {mb} MiB landing buffer {dt * 1e3:.1f} ms ({(mb << 20) / dt / 1e9:.2f} GB/s)")
