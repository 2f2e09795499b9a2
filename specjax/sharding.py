"""Tensor parallelism over a `jax.sharding.Mesh` with one axis, "tp".

The sharding of every parameter is derived from the logical axis names its `ParamSpec` declares
(`specjax.models.params`), through one table, `RULES`: attention heads (query and KV) and the MLP's hidden axis
are split over "tp"; everything else (embeddings, norms, head_dim) is replicated. The engine places the prefix
K/V it loads with the same KV-head sharding (`kv_sharding`), and the jitted steps are partitioned by XLA's GSPMD
from those shardings: each device projects, holds and attends over its own heads, and what needs all heads
(ITF's summed probe scores, H2O's union, the output projection and MLP sums) becomes a collective inside the
step, so every device sees one selection.

An axis is split only when its size divides the mesh: query heads that do not divide it are replicated, and
then so are the KV heads; KV heads that do not divide it (grouped-query models with fewer KV heads than devices)
are replicated while the query heads stay split. `plan` says what was chosen for a model, for results.

`tensor_parallel=1` (the default everywhere) builds no mesh at all: parameters and arrays stay as they were.
After `specjax.distributed.initialize` the devices are every process's, and a mesh must reach all processes: each
process then places only its own devices' slices of the parameters (`specjax.distributed.global_arrays`).
"""

from __future__ import annotations

import collections

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax import distributed
from specjax.config import ModelConfig
from specjax.errors import SpecjaxError
from specjax.models.params import is_spec, param_specs

TP = "tp"

# logical axis (ParamSpec.axes) -> mesh axis; absent: replicated. `plan` drops an entry whose size does not
# divide the mesh.
RULES: dict[str, str] = {"q_heads": TP, "kv_heads": TP, "ffw": TP}


def make_mesh(tensor_parallel: int, devices=None) -> Mesh | None:
    """A 1-D "tp" mesh over the first `tensor_parallel` devices (or `devices`); None for 1 (no mesh at all)."""
    n = int(tensor_parallel)
    if n < 1:
        raise SpecjaxError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
    if n == 1 and devices is None:
        return None
    available = list(jax.devices() if devices is None else devices)
    if n > len(available):
        raise SpecjaxError(f"tensor_parallel={n} needs {n} devices but {len(available)} are visible "
                           f"({available[0].platform}); on CPU set "
                           f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts")
    return Mesh(np.asarray(available[:n]), (TP,))


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else int(mesh.shape[TP])


def check_mesh(mesh: Mesh) -> None:
    if TP not in mesh.axis_names:
        raise SpecjaxError(f"the mesh needs an axis named {TP!r}; it has {mesh.axis_names}")
    if mesh.devices.size != mesh.shape[TP]:
        raise SpecjaxError(f"only a 1-D {TP!r} mesh is supported; got axes {dict(mesh.shape)}")
    processes = {d.process_index for d in mesh.devices.flat}
    if len(processes) != jax.process_count():  # a process with no device on the mesh could not run its steps
        raise SpecjaxError(f"the mesh's {mesh.devices.size} devices lie on {len(processes)} of the "
                           f"{jax.process_count()} processes, and every process needs some: use "
                           f"tensor_parallel={jax.device_count()} (every process's devices)")


def plan(cfg: ModelConfig, mesh: Mesh | None) -> dict[str, str]:
    """The logical axes of `cfg` split over the mesh: RULES, less those whose size does not divide it."""
    n = tp_size(mesh)
    if n == 1:
        return {}
    sizes = {"q_heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "ffw": cfg.intermediate_size}
    chosen = {axis: mesh_axis for axis, mesh_axis in RULES.items() if sizes.get(axis, 0) % n == 0}
    if "q_heads" not in chosen:  # a KV head's query heads must be on its device
        chosen.pop("kv_heads", None)
    return chosen


def describe(cfg: ModelConfig, mesh: Mesh | None) -> dict:
    """What results record: the mesh size and which logical axes it splits."""
    return {"tensor_parallel": tp_size(mesh), "sharded_axes": sorted(plan(cfg, mesh))}


def partition_spec(axes: tuple[str, ...], rules: dict[str, str]) -> PartitionSpec:
    return PartitionSpec(*(rules.get(a) for a in axes))


def param_shardings(cfg: ModelConfig, mesh: Mesh):
    """The parameter tree of `cfg` with a NamedSharding at every leaf, from its ParamSpec axes."""
    rules = plan(cfg, mesh)
    return jax.tree.map(lambda spec: NamedSharding(mesh, partition_spec(spec.axes, rules)), param_specs(cfg),
                        is_leaf=is_spec)


def shard_params(cfg: ModelConfig, params, mesh: Mesh | None):
    """`params` placed on the mesh (each device its slice of every split axis); unchanged without a mesh."""
    if mesh is None:
        return params
    check_mesh(mesh)
    if mesh.is_multi_process:
        return distributed.global_arrays(params, param_shardings(cfg, mesh))
    return jax.device_put(params, param_shardings(cfg, mesh))


def kv_sharding(cfg: ModelConfig, mesh: Mesh, heads: int | None = None) -> NamedSharding:
    """How K/V arrays [heads, tokens, head_dim] lie on the mesh: split by head when the model's KV heads are
    (and `heads`, if given, is all of them), else replicated (e.g. the few probe heads' keys)."""
    split = "kv_heads" in plan(cfg, mesh) and (heads is None or heads == cfg.num_kv_heads)
    return NamedSharding(mesh, PartitionSpec(TP if split else None, None, None))


def kv_parts(cfg: ModelConfig, mesh: Mesh | None, heads: int) -> int:
    """Over how many devices K/V arrays of `heads` heads are split (`kv_sharding`): the mesh's size, or 1 when
    every device holds them all (no mesh, replicated)."""
    if mesh is None or kv_sharding(cfg, mesh, heads).spec[0] != TP:
        return 1
    return tp_size(mesh)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


# How many layers a loop over them dispatches ahead of CPU devices of a mesh (`Pace`). XLA's CPU client runs each
# device's part of a multi-device program on one pool of max(host cores, devices) threads; launching a program holds
# a pool thread per device while that device already has its limit of programs queued (about 32), and a collective
# (the all-reduce of the output projection and of the MLP) needs a thread for every participant at once. With fewer
# threads than twice the mesh's devices (a 2-core host and --xla_force_host_platform_device_count equal to
# tensor_parallel), a host that queues more than that ahead leaves a participant without a thread and the
# rendezvous aborts the process. A layer of a request dispatches well under 16 programs on a device, so two layers in
# the queue stay below the limit, and the host's next layer still overlaps the device's current one.
PACE_LAYERS = 1


def paced(x) -> bool:
    """Whether a loop over layers of arrays like `x` keeps to `Pace`: `x` (a mesh, or an array placed on one) spans
    several CPU devices (PACE_LAYERS says why). One device runs no collective."""
    if isinstance(x, Mesh):
        devices = list(x.devices.flat)
    else:
        try:
            devices = list(x.sharding.device_set)
        except AttributeError:  # a host array, a traced value
            return False
    return len(devices) > 1 and all(d.platform == "cpu" for d in devices)


class Pace:
    """Keeps a loop over layers at most PACE_LAYERS layers ahead of CPU devices of a mesh (`paced`; see
    PACE_LAYERS): `step(tree)`, once a layer's programs are dispatched (`tree`: its results), waits until the
    layer PACE_LAYERS before it is done. Elsewhere it waits for nothing, and the host runs as far ahead as it does.
    `wait(tree)` blocks until tree is ready (the engine's clock passes its own, which records the wait)."""

    def __init__(self, like, wait=jax.block_until_ready):
        self.ahead = PACE_LAYERS if paced(like) else 0
        self._wait = wait
        self._layers: collections.deque = collections.deque()

    def step(self, tree):
        """`tree` (returned); first, if this loop is paced, the wait for the layer PACE_LAYERS back."""
        if self.ahead:
            self._layers.append(tree)
            if len(self._layers) > self.ahead:
                self._wait(self._layers.popleft())
        return tree


def head_mesh(x) -> Mesh | None:
    """The mesh whose "tp" axis splits array `x` by its first (head) axis; None when it is not (one device,
    replicated, or a traced value)."""
    try:
        sharding = x.sharding
    except AttributeError:
        return None
    if isinstance(sharding, NamedSharding) and len(sharding.spec) and sharding.spec[0] == TP:
        return sharding.mesh
    return None
