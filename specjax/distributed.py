"""Several processes (on one host or many) as one JAX runtime, so a tensor-parallel mesh (specjax.sharding) spans
every process's devices.

JAX runs one program in every process (multi-controller): each process calls `initialize` before anything else,
loads the same weights, and gives its own devices their slices (`global_arrays`); `jax.devices()` then lists every
process's devices, jitted steps run on all of them at once, and a result split over other processes' devices is
gathered before it reaches the host (`to_host`). One process (no `initialize`) is unchanged.
"""

from __future__ import annotations

import atexit
import inspect
import json
import os
import pathlib
import subprocess
import sys
import threading
import time
import zlib

import jax
import numpy as np
from jax.experimental import multihost_utils

from specjax.errors import SpecjaxError

CPU_COLLECTIVES_OPTION = "jax_cpu_collectives_implementation"
# `initialize`'s watch over the other processes: each process shows a sign of life every BEAT_S seconds through the
# runtime's key-value store; one silent for `peer_timeout_s` is taken for dead, and this process stops with one line
# on stderr and this exit status, rather than wait in a collective that will never complete
BEAT_S = 2.0
PEER_LOST_EXIT = 3
_runtime_log: subprocess.Popen | None = None  # `_runtime_log_in_one_line`'s child process


def cpu_collectives_supported() -> bool:
    """Whether this JAX can run collectives between CPU processes (its option to choose how exists)."""
    return hasattr(jax.config, CPU_COLLECTIVES_OPTION)


def initialize(coordinator_address: str, num_processes: int, process_id: int, *, cpu_collectives: str = "gloo",
               timeout_s: int = 300, peer_timeout_s: float = 30.0) -> None:
    """Join this process to the `num_processes` processes whose process 0 listens at `coordinator_address`
    ("host:port", the same in every process), as process `process_id`.

    It must come before anything that starts JAX's backends (a computation, `jax.devices()`, loading a model),
    because the devices a backend sees are fixed when it starts. CPU devices exchange their collectives over
    `cpu_collectives` ("gloo": TCP, nothing to install); GPUs use NCCL whatever it says.

    A process that dies (killed, out of memory, its host lost) would leave the others waiting in a collective: a
    process that hears nothing from another for `peer_timeout_s` seconds exits with status PEER_LOST_EXIT and one
    line on stderr that names it (JAX's own heartbeat check, which aborts every process with a stack trace, is set
    later than that).
    """
    host, _, port = str(coordinator_address).rpartition(":")
    if not host or not port.isdigit():
        raise SpecjaxError(f"coordinator_address must be HOST:PORT (process 0's address), got {coordinator_address!r}")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise SpecjaxError(f"num_processes must be a positive integer, got {num_processes!r}")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise SpecjaxError(f"process_id must be one of 0..{num_processes - 1} (each process its own), "
                           f"got {process_id!r}")
    if jax.distributed.is_initialized():
        raise SpecjaxError("this process has already joined a distributed runtime; initialize it once")
    if not cpu_collectives_supported():
        raise SpecjaxError(f"jax {jax.__version__} cannot run collectives between CPU processes "
                           f"(no {CPU_COLLECTIVES_OPTION} option); upgrade jax")
    jax.config.update(CPU_COLLECTIVES_OPTION, cpu_collectives)
    if num_processes > 1:
        _runtime_log_in_one_line(process_id, num_processes)
    later = {"heartbeat_timeout_seconds": int(peer_timeout_s + 30)}
    if "heartbeat_timeout_seconds" not in inspect.signature(jax.distributed.initialize).parameters:
        later = {}
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                   initialization_timeout=timeout_s, **later)
    except RuntimeError as e:
        if "before any JAX calls" in str(e):
            raise SpecjaxError("specjax.distributed.initialize must run before JAX starts (before any computation, "
                               "jax.devices() or load_model): call it first thing in the program") from e
        raise
    if num_processes > 1:
        _watch_peers(process_id, num_processes, peer_timeout_s)
        _stop_on_errors(process_id, num_processes)


def _runtime_log_in_one_line(me: int, n: int) -> None:
    """What JAX's runtime writes to this process's stderr (file descriptor 2) passes through `specjax.runtime_log`, a
    child process that says the runtime's fatal abort (process 0 lost) in one line. Python's own `sys.stderr` keeps
    writing where stderr went before (a terminal stays one), where it wrote to file descriptor 2."""
    global _runtime_log
    sys.stderr.flush()
    mine = os.dup(2)
    read, write = os.pipe()
    script = pathlib.Path(__file__).with_name("runtime_log.py")
    _runtime_log = subprocess.Popen([sys.executable, "-I", str(script), str(me), str(n)], stdin=read, stdout=mine,
                                    stderr=mine)  # it ends when every copy of this process's stderr is closed
    os.dup2(write, 2)
    os.close(read), os.close(write)
    try:
        direct = sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):  # a stream of its own (a notebook's, a test's capture)
        direct = False
    if direct:
        sys.stderr = os.fdopen(mine, "w", buffering=1, encoding=sys.stderr.encoding, errors="backslashreplace")
    else:
        os.close(mine)


def _runtime_client():
    """The runtime's client of process 0's key-value store (JAX has no public name for it)."""
    from jax._src import distributed as runtime  # noqa: PLC0415

    return runtime.global_state.client


def _watch_peers(me: int, n: int, silent_s: float) -> None:
    """A daemon thread: this process's sign of life (a counter it increments) every BEAT_S seconds, and the others'
    read; a process whose counter stays still for `silent_s` seconds without having said it is done (at exit), or a
    store that no longer answers (process 0's), ends this process (`_peer_lost`)."""
    client = _runtime_client()
    done = threading.Event()
    atexit.register(lambda: (done.set(), _try(client.key_value_set, f"specjax/done/{me}", "1", True)))

    def watch() -> None:
        seen = {p: (None, time.monotonic()) for p in range(n) if p != me}
        while not done.wait(BEAT_S):
            try:
                client.key_value_increment(f"specjax/alive/{me}", 1)
                for p, (count, since) in seen.items():
                    now = _try(client.key_value_try_get, f"specjax/alive/{p}")  # None: not set yet
                    if now != count:
                        seen[p] = (now, time.monotonic())
                    elif time.monotonic() - since > silent_s and not _try(client.key_value_try_get,
                                                                          f"specjax/done/{p}"):
                        _peer_lost(me, n, f"process {p} has shown no sign of life for {silent_s:.0f} s")
            except Exception as e:  # noqa: BLE001 -- process 0's store gone: process 0 died
                if not done.is_set():
                    _peer_lost(me, n, f"process 0 (the coordinator) stopped answering ({type(e).__name__})")

    threading.Thread(target=watch, name="specjax-peers", daemon=True).start()


def _try(fn, *args):
    """fn(*args), or None where it raises (a key not set yet)."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001
        return None


def _stop_on_errors(me: int, n: int) -> None:
    """An error no one caught ends this process at once, without JAX's exit barrier, which waits for every process
    and, when one is gone, aborts after its heartbeat timeout with a stack trace. A failed step across processes
    (another process gone) is said in one line (`_peer_lost`); any other error as Python says it, then that line."""
    said = sys.excepthook

    def hook(kind, error, trace) -> None:
        first = (str(error).strip().splitlines() or [""])[0][:300]
        if isinstance(error, jax.errors.JaxRuntimeError):
            _peer_lost(me, n, f"a step across processes failed: {first}")
        said(kind, error, trace)
        _peer_lost(me, n, f"{kind.__name__}: {first}", status=1, cause="")

    sys.excepthook = hook


def _peer_lost(me: int, n: int, why: str, status: int = PEER_LOST_EXIT,
               cause: str = " (another process killed or crashed?)") -> None:
    """Say in one line why this process stops, and stop it at once: nothing it has not committed is kept."""
    sys.stdout.flush()
    sys.stderr.flush()
    line = f"specjax: process {me} of {n} stops: {why}{cause}; its uncommitted work is dropped\n"
    try:
        if _runtime_log is None:
            sys.stderr.write(line)
        else:  # through the runtime log, after what it holds back
            os.write(2, line.encode())
    except OSError:
        sys.stderr.write(line)
    sys.stderr.flush()
    os._exit(status)


def global_arrays(host_tree, shardings):
    """Arrays on a mesh over several processes, from the whole arrays every process holds on its host: each
    process hands only its own devices their slices, so nothing crosses between processes (`jax.device_put`
    would gather every array from every process to check that they agree). The processes must hold the same
    values: a digest of them is compared once, and differing ones are an error."""
    host_tree = jax.tree.map(np.asarray, host_tree)
    check_same_everywhere(jax.tree.leaves(host_tree), "the weights")
    return jax.tree.map(_place, host_tree, shardings)


def _place(x: np.ndarray, sharding):
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def check_same_everywhere(arrays: list[np.ndarray], what: str) -> None:
    """Raise unless every process holds the same `arrays` (one CRC-32 each, gathered from all processes)."""
    digest = np.asarray([zlib.crc32(np.ascontiguousarray(x).reshape(-1).view(np.uint8)) for x in arrays], np.uint32)
    every = np.asarray(multihost_utils.process_allgather(digest))  # [processes, arrays]
    differ = [p for p in range(len(every)) if not np.array_equal(every[p], every[0])]
    if differ:
        raise SpecjaxError(f"{what} on processes {differ} differ from process 0's: every process must load the "
                           "same checkpoint (or random init with the same seed and dtype)")


def to_host(x) -> np.ndarray:
    """`x` whole, as a host array: one split over other processes' devices is gathered from them first (every
    process must call this with it). One process: `np.asarray(x)`."""
    if getattr(x, "is_fully_addressable", True) or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# -- an engine on a mesh over several processes (specjax.engine.Engine) ---------------------------------------------


def spans_processes(mesh) -> bool:
    """Whether `mesh` (or None: one device) has devices of several processes."""
    return mesh is not None and mesh.is_multi_process


def own_parts(mesh) -> range:
    """The positions along the mesh (its one axis) of this process's devices: one contiguous run, since a mesh
    lists every process's devices together (`jax.devices()` order)."""
    mine = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()]
    if not mine or mine != list(range(mine[0], mine[-1] + 1)):
        raise SpecjaxError(f"process {jax.process_index()}'s devices lie at mesh positions {mine}: they must be one "
                           "contiguous run (build the mesh from jax.devices() in its order)")
    return range(mine[0], mine[-1] + 1)


def from_own_rows(local, sharding):
    """A global array of `local`'s shape on `sharding`, each of this process's devices given its slice of `local`:
    an array (host or on one local device) of which this process holds valid data only where its own devices' slices
    lie (e.g. its KV heads). Nothing crosses between processes."""
    indices = sharding.addressable_devices_indices_map(local.shape)
    shards = [jax.device_put(local[index], device) for device, index in indices.items()]
    return jax.make_array_from_single_device_arrays(local.shape, sharding, shards)


def local_replica(x):
    """`x` as an array on this process's first device: a global array every device holds whole (a decision of a
    step over the mesh) gives its copy there; any other array is returned as it is."""
    if getattr(x, "is_fully_addressable", True):
        return x
    if not x.is_fully_replicated:
        raise SpecjaxError(f"an array split over several processes ({x.sharding}) has no whole copy on this one")
    first = jax.local_devices()[0]
    for shard in x.addressable_shards:
        if shard.device == first:
            return shard.data
    return jax.device_put(x.addressable_data(0), first)


def join_parts(own: np.ndarray, axis: int) -> np.ndarray:
    """This process's part of a host array (along `axis`, processes in order) joined with every other process's
    into the whole, the same in every process (every process must call this with its part)."""
    every = np.asarray(multihost_utils.process_allgather(np.ascontiguousarray(own)))  # [processes, ...]
    return np.concatenate(list(every), axis=axis)


def max_over_processes(value: int) -> int:
    """The largest of every process's `value`, in every process (every process must call this)."""
    return int(np.asarray(multihost_utils.process_allgather(np.asarray([int(value)], np.int64))).max())


def any_process(flag: bool) -> bool:
    """Whether `flag` holds on any process (every process must call this)."""
    return max_over_processes(bool(flag)) > 0


def process_zeros(value):
    """Process 0's `value` (an array or a tree of them), in every process (every process must call this)."""
    return multihost_utils.broadcast_one_to_all(value)


def gather_json(value) -> list:
    """Every process's `value` (anything `json` writes), in process order, in every process (every process must
    call this)."""
    mine = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.asarray([len(mine)], np.int64))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:len(mine)] = mine
    every = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(every, lengths)]


def process_zeros_json(value):
    """Process 0's `value` (anything `json` writes), in every process (every process must call this)."""
    return gather_json(value)[0]


def barrier(name: str) -> None:
    """Wait until every process has reached the barrier `name`."""
    multihost_utils.sync_global_devices(name)
