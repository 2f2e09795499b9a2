"""An engine whose model's mesh spans several processes (`specjax.distributed`): what its processes do alike and what
one of them does for all.

Every process runs the same requests, steps and collectives in the same order (JAX's multi-controller runtime). Each
reads, caches and places on its devices only its own devices' KV heads (`read_split`, `distributed.from_own_rows`);
heads that every device holds (a few probe heads' keys) are split among the processes instead (`by_process`). What
needs every head is decided by a step over the whole mesh, so every process holds the same decision. What the
processes must agree on besides is agreed here, once each:

- writes (`SharedWriter`): each layer's new KV is gathered whole in every process (a collective), process 0 alone
  writes and commits it, and every process waits for the commit and adopts it before its next match;
- a bad chunk (`LayerIO.agree_on_bad_chunks`): a process that finds one goes on, and at the end of the layer loop every
  process learns whether any found one, so that all recompute the request, or none;
- reordering the store (`reorder`): process 0 repacks, reading every head of what it copies, and the others wait
  and adopt it; repairing damaged stored prefixes (`drop_failing`) likewise: process 0 checks every head and drops
  them, and every process stores them anew (`SharedWriter`);
- opening a store (`opened_in_turn`): process 0 first, which makes it where there is none, then the others;
- Cake's meeting point (`cake._Meeting`): before each layer of a chunk the device computes, the processes agree on
  where the loaded chunks begin (the latest start any process's loader has reached), so all compute, absorb and
  stop alike; each loader reads its own heads at its own pace.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax import distributed
from specjax import sharding as sh
from specjax.connector import Reorderer, StoreError

PROCESSES = "processes"  # the axis of `by_process`


def by_process(cfg, mesh: Mesh, heads: int) -> NamedSharding | None:
    """Where K/V arrays of `heads` heads that every device of the mesh holds whole (a few probe heads' keys, or KV
    heads that do not divide the mesh: `sharding.kv_sharding` replicates them) lie instead: split over the
    processes, each process's devices holding its part, so that each process reads its part alone; a step over the
    mesh gathers them where it needs every head. None where the mesh splits them by device already, or the processes
    do not divide them."""
    processes = len({d.process_index for d in mesh.devices.flat})
    if sh.kv_parts(cfg, mesh, heads) > 1 or heads % processes:
        return None
    grid = Mesh(mesh.devices.reshape(processes, -1), (PROCESSES, sh.TP))
    return NamedSharding(grid, PartitionSpec(PROCESSES, None, None))


def read_split(cfg, mesh: Mesh, layout) -> dict:
    """`KVStore.split_reads`'s arguments for this process of a mesh over several processes: each kind is read as
    its process's heads (the mesh's devices', or the processes' parts: `by_process`)."""
    parts, own, split = {}, {}, set()
    for kind in layout.kinds():
        heads = layout.heads(kind)
        parts[kind] = sh.kv_parts(cfg, mesh, heads)
        if parts[kind] > 1:
            own[kind] = distributed.own_parts(mesh)
        elif (shared := by_process(cfg, mesh, heads)) is not None:
            parts[kind] = shared.mesh.shape[PROCESSES]
            own[kind] = range(jax.process_index(), jax.process_index() + 1)
            split.add(kind)
    return {"devices": parts, "own": own, "by_process": frozenset(split)}


def writes() -> bool:
    """Whether this process writes the shared store (process 0)."""
    return jax.process_index() == 0


def adopt_commits(store, name: str) -> None:
    """Wait until every process has reached `name` (process 0 having committed before it), then take in what was
    committed."""
    distributed.barrier(name)
    store.refresh(force=True)


def reorder(store) -> int:
    """Process 0 repacks every radix node whose importance it observed (every process observed the same), reading
    every head of the chunks it copies (`KVStore.every_head`; its reads are otherwise its own heads'), and every
    process adopts the repacked store. Returns the nodes repacked (0 in the other processes)."""
    repacked = 0
    if writes():
        with store.every_head():
            repacked = Reorderer(store).run_once()
    adopt_commits(store, "specjax-reorder")
    return repacked


def drop_failing(store, key) -> list[list[int]]:
    """Process 0 checks every head of the stored prefixes on `key`'s path (`KVStore.every_head`; a process's reads
    are otherwise its own heads') and drops those holding a failing chunk, with what is stored below them; every
    process adopts that and gets the token sequences dropped. A failure there is raised in every process."""
    lost, failed = [], None
    if writes():
        try:
            with store.every_head():
                with store.match(key) as match:
                    failing = store.failing_nodes(match)
                lost = [[int(t) for t in sequence] for sequence in store.drop_nodes(failing)]
        except StoreError as e:
            failed = str(e)
    lost, failed = distributed.process_zeros_json([lost, failed])
    if failed is not None:
        raise StoreError(f"process 0 could not drop the damaged stored prefixes: {failed}")
    adopt_commits(store, "specjax-repair")
    return lost


class SharedWriter:
    """`store.begin_insert(prefix, base=match)` for an engine on a mesh over several processes, with a prefix writer's
    calls (`write_layer`, `commit`, `abort`, a context): process 0 writes; every process gathers each layer whole
    (every process must make the same calls) and, at the commit, waits for it and adopts it."""

    def __init__(self, store, prefix, base):
        self.store, self.base = store, base
        self.writer = store.begin_insert(prefix, base=base) if writes() else None  # it owns `base` from here

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        if kind is not None:
            self.abort()

    def write_layer(self, layer: int, k, v, probe_k=None) -> None:
        k, v = distributed.to_host(k), distributed.to_host(v)
        probe_k = None if probe_k is None else distributed.to_host(probe_k)
        if self.writer is not None:
            self.writer.write_layer(layer, k, v, probe_k)

    def commit(self):
        """Process 0's commit (its new node; None elsewhere), once every process has it."""
        node, failed = None, None
        try:
            if self.writer is not None:
                node = self.writer.commit()
            self._let_go_of_base()
        except Exception as e:  # noqa: BLE001 -- the others wait at the barrier all the same, then it is raised
            failed = e
        adopt_commits(self.store, "specjax-commit")
        if failed is not None:
            raise failed
        return node

    def abort(self) -> None:
        """Drop what was written (no commit, nothing to wait for); a no-op once committed."""
        if self.writer is not None:
            self.writer.abort()
        self._let_go_of_base()

    def _let_go_of_base(self) -> None:
        """Close the match written over, where no writer owns it (the processes that do not write)."""
        if self.writer is None and self.base is not None:
            self.base.close()
            self.base = None


def opened_in_turn(open_store):
    """`open_store()` in every process of a runtime of several (one process: just that): process 0 first, which
    makes the store where there is none, then the others."""
    if jax.process_count() == 1:
        return open_store()
    store = open_store() if writes() else None
    distributed.barrier("specjax-open")
    return store if store is not None else open_store()
