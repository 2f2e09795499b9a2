"""Running several worker processes on localhost as one JAX runtime (specjax.distributed), each with its own forced
CPU devices, for the tests that compare them with one process (test_distributed.py, test_store_processes.py)."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import pytest

from specjax import distributed

PROCESSES, DEVICES_PER_PROCESS = 2, 2

needs_cpu_collectives = pytest.mark.skipif(not distributed.cpu_collectives_supported(),
                                           reason=f"jax {jax.__version__} cannot run collectives between CPU "
                                                  "processes")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start_workers(worker: pathlib.Path, out: pathlib.Path, args: list[str]) -> list[subprocess.Popen]:
    """`python WORKER HOST:PORT PROCESSES PROCESS_ID OUT ARGS...` started in PROCESSES processes (pipes for their
    stdout and stderr)."""
    address = f"localhost:{free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                          + f" --xla_force_host_platform_device_count={DEVICES_PER_PROCESS}").strip())
    return [subprocess.Popen([sys.executable, str(worker), address, str(PROCESSES), str(i), str(out), *args],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=worker.parent.parent) for i in range(PROCESSES)]


def run_workers(worker: pathlib.Path, out: pathlib.Path, args: list[str], timeout_s: float) -> list[dict]:
    """`start_workers`' reports (each one's last stdout line, a JSON object), in process order; every worker is
    killed if it outlives `timeout_s`."""
    done = finish(start_workers(worker, out, args), timeout_s)
    return [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in done]


def finish(workers: list[subprocess.Popen], timeout_s: float) -> list[tuple[str, str]]:
    """Each worker's (stdout, stderr) once it exits with status 0; every one is killed if it outlives `timeout_s`."""
    try:
        done = [w.communicate(timeout=timeout_s) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    for w, (_, stderr) in zip(workers, done):
        assert w.returncode == 0, stderr[-4000:]
    return done
