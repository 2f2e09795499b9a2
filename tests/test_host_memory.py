"""specjax.host_memory: a jitted step's large temporaries come back from the heap, not as fresh pages per call."""

import os
import subprocess
import sys

import pytest

from specjax import host_memory

pytestmark = pytest.mark.skipif(host_memory._glibc() is None, reason="glibc's malloc only")

# One step whose temporaries (a 64 MiB product) exceed glibc's largest mmap threshold (32 MiB): the median page
# faults of its calls.
FAULTS_PER_CALL = """
import resource, sys
import specjax  # applies the settings before XLA's threads start
from specjax import host_memory
import jax, jax.numpy as jnp

step = jax.jit(lambda a, b: jnp.sin(a @ b).sum(0))
a, b = jnp.ones((4096, 64)), jnp.ones((64, 4096))
temp = step.lower(a, b).compile().memory_analysis().temp_size_in_bytes
for _ in range(4):  # the heap settles: a block freed only after the next call began is not yet reusable
    step(a, b).block_until_ready()
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step(a, b).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(host_memory.reuse_freed_blocks(), temp, sorted(faults)[len(faults) // 2])
"""


def _faults_per_call(malloc: str) -> tuple[bool, int, float]:
    env = os.environ | {host_memory.ENV_VAR: malloc, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", FAULTS_PER_CALL], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    applied, temp, faults = out.stdout.split()
    return applied == "True", int(temp), float(faults)


def test_a_steps_temporaries_are_reused_across_calls():
    applied, temp, reused = _faults_per_call("reuse")
    assert applied and temp > 32 << 20
    untouched, _, fresh = _faults_per_call("system")
    assert not untouched
    assert fresh > 0.5 * temp / 4096  # glibc's defaults: the temporaries are mapped and faulted in on every call
    assert reused < 0.05 * fresh


def test_an_unknown_setting_is_refused(monkeypatch):
    monkeypatch.setenv(host_memory.ENV_VAR, "jemalloc")
    with pytest.raises(ValueError, match="SPECJAX_HOST_MALLOC"):
        host_memory.choice()
