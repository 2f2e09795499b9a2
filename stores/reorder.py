"""KV reordering (SPEC IV-D): within one radix node, sort tokens by average importance and repack their KV
so important tokens share chunks; copy-on-write into new chunks, then an atomic metadata swap.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from specjax.stores.store import KVStore, Locations

log = logging.getLogger(__name__)


def importance_order(avg_importance: np.ndarray) -> np.ndarray:
    """Original token indices in descending importance (stable, so ties keep prefix order)."""
    return np.argsort(-avg_importance, kind="stable")


def reorder_node(store: KVStore, node_id: int, *, min_tokens: int | None = None) -> bool:
    """Repack one node by importance; returns True if the store now serves the reordered version.

    Readers are never blocked: they keep reading the old chunks until the swap, and any match opened before
    it keeps the old version (its chunks are deleted only after such matches close).
    """
    min_tokens = store.layout.chunk_tokens + 1 if min_tokens is None else min_tokens
    avg = store.node_importance(node_id)
    if len(avg) < min_tokens:
        return False  # fits in about one chunk: nothing to gain
    order = importance_order(avg)
    seg_id, seg_start, n, snapshot = store.node_view(node_id)
    with snapshot:
        locations = store.locate(snapshot, order)
        if _already_in_order(store, locations):
            return False
        writer = store.new_segment_writer(n)
        try:
            if not _copy(store, snapshot, locations, writer):
                writer.abort()
                return False
            writer.wait_durable()
            mapping = np.argsort(order)  # m[i] = new stored position of original token i
            if store.swap_segment(node_id, (seg_id, seg_start, n), writer, mapping):
                return True
        except BaseException:
            writer.abort()
            raise
        writer.abort()
        return False


def _already_in_order(store: KVStore, loc: Locations) -> bool:
    """True when the desired order is already how the tokens are laid out."""
    flat = loc.chunks * store.layout.chunk_tokens + loc.offsets
    return bool(np.all(np.diff(flat) == 1))


def _copy(store: KVStore, snapshot, loc: Locations, writer) -> bool:
    """Copy every layer's K, V (and probe keys) in the new order; False if a source chunk is bad."""
    kinds = store.layout.kinds()
    for layer in range(store.layout.num_layers):
        futures = [store.read_locations(layer, kind, loc) for kind in kinds]
        gathered = [f.result() for f in futures]
        if not all(g.ok.all() for g in gathered):
            log.warning("node reorder skipped: a source chunk failed its checksum")
            return False
        writer.write_layer(layer, *(g.array for g in gathered))
    return True


class Reorderer:
    """Background thread that reorders every node with enough importance observations, every `interval_s`."""

    def __init__(self, store: KVStore, interval_s: float = 600.0, min_observations: int = 1):
        self.store, self.interval_s, self.min_observations = store, interval_s, min_observations
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reordered = 0

    def run_once(self) -> int:
        """Reorder each node observed since its last repack; returns how many were repacked."""
        done = 0
        for node_id in self.store.node_ids():
            try:
                if self.store.node_observations(node_id) < self.min_observations:
                    continue
                if reorder_node(self.store, node_id):
                    done += 1
            except KeyError:
                continue  # evicted or split away meanwhile
        self.reordered += done
        return done

    def start(self) -> "Reorderer":
        self._thread = threading.Thread(target=self._loop, name="kv-reorder", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except Exception:  # noqa: BLE001 -- reordering is an optimisation; never kill the process
                log.exception("background reorder failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
