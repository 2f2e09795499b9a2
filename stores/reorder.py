"""KV reordering (SPEC IV-D): within one radix node, sort tokens by average importance and repack their KV
so important tokens share chunks; copy-on-write into new chunks, then an atomic metadata swap.

By default every layer gets its own order (its own mapping list), as SPEC's implementation keeps reordered
KV and mapping lists per layer: layers pick different tokens, so one order for all layers packs each layer's
important tokens less densely. `per_layer=False` sorts once by importance averaged over layers.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from specjax.stores.kvarray import PROBE, K, V
from specjax.stores.store import KVStore, Locations

log = logging.getLogger(__name__)


def importance_order(avg_importance: np.ndarray) -> np.ndarray:
    """Original token indices in descending importance (stable, so ties keep prefix order)."""
    return np.argsort(-avg_importance, kind="stable")


def reorder_node(store: KVStore, node_id: int, *, min_tokens: int | None = None, per_layer: bool = True) -> bool:
    """Repack one node by importance; returns True if the store now serves the reordered version.

    Readers are never blocked: they keep reading the old chunks until the swap, and any match opened before
    it keeps the old version (its chunks are deleted only after such matches close).
    """
    min_tokens = store.layout.chunk_tokens + 1 if min_tokens is None else min_tokens
    avg = store.node_importance(node_id, per_layer=True)  # [layers, n]
    if avg.shape[1] < min_tokens:
        return False  # fits in about one chunk: nothing to gain
    orders = np.stack([importance_order(row) for row in avg]) if per_layer else importance_order(avg.mean(0))
    layer_orders = orders if per_layer else [orders] * len(avg)
    try:
        return _repack(store, node_id, orders, layer_orders)
    finally:
        store.collect_garbage()  # the old chunks, now that the copy's own snapshot is closed (caches drop them)


def _repack(store: KVStore, node_id: int, orders: np.ndarray, layer_orders) -> bool:
    seg_id, seg_start, n, snapshot = store.node_view(node_id)
    with snapshot:
        locations = [store.locate(snapshot, order, layer) for layer, order in enumerate(layer_orders)]
        if all(_already_in_order(store, loc) for loc in locations):
            return False
        writer = store.new_segment_writer(n)
        try:
            if not _copy(store, locations, writer):
                writer.abort()
                return False
            writer.wait_durable()
            mapping = np.argsort(orders, axis=-1)  # m[(layer,) i] = new stored position of original token i
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


def _copy(store: KVStore, locations: list[Locations], writer) -> bool:
    """Copy every layer's K, V (and probe keys) in its new order; False if a source chunk is bad. Their low-bit forms
    are encoded anew from them by the writer: V's and probe keys' rows equal the source's (a row's encoding depends on
    that row alone), K's codes are against the ranges of the chunks it now lies in."""
    kinds = tuple(kind for kind in store.layout.kinds() if kind in (K, V, PROBE))
    for layer, loc in enumerate(locations):
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
