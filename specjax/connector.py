"""Stored prefix KV for a model's own layer loop: one request at a time, match -> start loading -> per layer wait and
save -> finish (the shape of vLLM's KV connector).

    store = specjax.open_store(model, "/tmp/kv")
    conn = specjax.Connector(store)
    reused = conn.begin(tokens)                 # how many leading tokens' KV the store holds, pinned until finish()
    conn.start_load()                           # every layer's reads go to the disk now, in layer order
    for layer in range(num_layers):
        k, v = conn.wait_for_layer(layer)       # [kv_heads, reused, head_dim] on the device: tokens[:reused]
        ...                                     # the layer over tokens[reused:], attending to k, v and their own
        conn.save_layer(layer, k_own, v_own)    # optional: tokens[reused:]'s K and V, to store the longer prefix
    conn.finish()                               # commits what was saved (every layer, or nothing), lets go

This module is also the one way the engine reaches storage: `specjax.engine` imports nothing of `specjax.stores`
but what this module imports from them (the store and its match, reads and writes, the device and host tiers, the
prefetcher over them, the store kinds and their precisions, reordering), so the import graph runs engine ->
connector -> stores, and the stores import no model and no engine (`tests/test_imports.py`).

The connector sees no model: shapes are the store's (`store.layout`), and which model's KV the store holds was checked
when it was opened (`specjax.open_store`). It loads every stored position of every layer (what `as_full` loads);
selecting what to load is the engine's job (`specjax.prefill_engine`). Reads go through the store's prefetcher:
each layer's K and V are read as few large extents, checked against their checksums, and waited for only when the
layer needs them. `examples/decode_loop.py` is a serving loop that uses it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from specjax.errors import SpecjaxError
from specjax.shapes import bucket
from specjax.stores import PROBE, K, Locations, V, KVStore, StoreError
from specjax.stores.caches import POLICIES as CACHE_POLICIES
from specjax.stores.caches import TieredCache
from specjax.stores.kvarray import K_RANGE, LOW_BIT_FORMAT, LOW_BITS, Layout, bits_of, in_chunk_range, low_bit
from specjax.stores.prefetch import Prefetcher
from specjax.stores.reorder import Reorderer

# The imports above are what the engine uses of the storage below it: the store (`KVStore`: match, locate, key
# summaries, writes, metrics), where positions lie (`Locations`), its errors, the kinds a chunk holds (K, V, PROBE)
# and their low-bit forms (`Layout`, `LOW_BITS`, `low_bit`, `bits_of`, `K_RANGE`, `in_chunk_range`, `LOW_BIT_FORMAT`),
# the device and host tiers and their scoring policies (`TieredCache`, `CACHE_POLICIES`), the prefetcher reading
# through them, and reordering.


class CorruptPrefixError(StoreError):
    """A chunk of the stored prefix failed its checksum: compute the request without it (`finish()` first)."""


class Connector:
    """A stored prefix's KV, layer by layer, for one request at a time (see the module doc)."""

    def __init__(self, store: KVStore):
        self.store = store
        self.layout = store.layout
        self.prefetcher = Prefetcher(store)
        self._match = None
        self._tokens: np.ndarray | None = None
        self.reused = 0  # leading tokens of the open request whose KV is loaded from the store
        self._loading = False
        self._writer = None
        self._saved: set[int] = set()

    # -- one request ------------------------------------------------------------------------------

    def begin(self, tokens) -> int:
        """Open a request over `tokens` (its whole prompt): the number of its leading tokens whose KV the store holds,
        at most all but the last (whose logits a model must compute). The stored prefix stays readable until
        `finish()`."""
        if self._tokens is not None:
            raise SpecjaxError("a request is open on this connector: finish() it before beginning another")
        tokens = np.asarray(tokens, np.int64).reshape(-1)
        if len(tokens) == 0:
            raise SpecjaxError("a request needs at least one token")
        self._tokens, self._match = tokens, self.store.match(tokens)
        self.reused = min(self._match.length, len(tokens) - 1)
        return self.reused

    def start_load(self) -> None:
        """Ask the disk for every layer's K and V of the reused tokens now, in layer order; returns at once."""
        self._require_open()
        if self._loading or not self.reused:
            return
        positions = np.arange(self.reused)
        for layer in range(self.layout.num_layers):
            for kind in (K, V):
                self.prefetcher.request(self._match, layer, kind, positions)
        self._loading = True

    def wait_for_layer(self, layer: int):
        """`(k, v)`: layer `layer`'s keys and values of the reused tokens on the device, each `[kv_heads, reused,
        head_dim]` of the store's dtype (keys position-encoded as the model stored them); waits only for reads
        still in flight (`start_load` first, or this reads the layer now). A chunk that fails its checksum raises
        `CorruptPrefixError`: nothing of it is returned."""
        self._require_open()
        self._check_layer(layer)
        lay = self.layout
        if not self.reused:
            empty = jnp.zeros((lay.kv_heads, 0, lay.head_dim), lay.np_dtype)
            return empty, empty
        positions = np.arange(self.reused)
        out = []
        for kind in (K, V):
            taken = self.prefetcher.take(self._match, layer, kind, positions, pad_to=bucket(self.reused))
            if not taken.ok.all():
                raise CorruptPrefixError(
                    f"the stored KV of layer {layer} failed its checksum in {self.store.where}: finish() this request "
                    f"and compute it without the store; drop_damaged(tokens) then removes the damaged prefix so it can "
                    f"be saved anew (`python -m specjax.stores.fsck` finds such chunks)")
            out.append(taken.array[:, :self.reused])
        return tuple(out)

    def save_layer(self, layer: int, k, v) -> None:
        """Queue layer `layer`'s K and V of the request's own tokens (`tokens[reused:]`, each `[kv_heads, n,
        head_dim]`) to store the whole prompt as a prefix; written in the background, published by `finish()`
        once every layer is saved. Does nothing where the store holds the whole prompt already."""
        self._require_open()
        self._check_layer(layer)
        if self.store.read_only:
            raise StoreError(f"the store at {self.store.where} was opened read-only: nothing can be saved to it")
        start = self._match.length  # the stored prefix may reach past `reused` (a prompt stored whole)
        if start >= len(self._tokens):
            return
        if self._writer is None:
            self._writer = self.store.begin_insert(self._tokens, base=self._match)
        k, v = np.asarray(k), np.asarray(v)  # start == reused here: the own tokens are exactly what is new
        # the store's probe kind holds the leading KV heads (those of SPEC's probe query heads, the first ones:
        # `specjax.engine.policy_steps.probe_kv_heads`)
        self._writer.write_layer(layer, k, v, k[:self.layout.probe_heads] if self.layout.probe_heads else None)
        self._saved.add(layer)

    def finish(self) -> int | None:
        """End the request: publish what `save_layer` queued if every layer was saved (returns the new prefix's node
        id, or None where nothing was stored or another writer stored it first), or discard a partial save; the
        stored prefix it read is let go either way."""
        self._require_open()
        writer, match = self._writer, self._match
        complete = len(self._saved) == self.layout.num_layers
        self._tokens, self._match, self._writer, self._saved = None, None, None, set()
        self.reused, self._loading = 0, False
        node = None
        try:
            self.prefetcher.close()
        finally:
            try:
                if writer is not None and complete:
                    node = writer.commit()  # it closes the match, whatever happens
                elif writer is not None:
                    writer.abort()
            finally:
                match.close()  # a no-op once closed
        return node

    def drop_damaged(self, tokens) -> list[list[int]]:
        """After a `CorruptPrefixError` (and `finish()`): remove from the store the stored prefixes of `tokens` that
        hold a chunk failing its checksum, with everything stored below them, so the prompt can be computed and saved
        anew. Returns the token sequences that were stored through them (the caller's to store again if it wants)."""
        if self._tokens is not None:
            raise SpecjaxError("a request is open on this connector: finish() it before dropping damaged prefixes")
        with self.store.match(np.asarray(tokens, np.int64).reshape(-1)) as match:
            failing = self.store.failing_nodes(match)
        return [np.asarray(seq).tolist() for seq in self.store.drop_nodes(failing)]

    # -- checks -----------------------------------------------------------------------------------

    def _require_open(self) -> None:
        if self._tokens is None:
            raise SpecjaxError("no request is open on this connector: begin(tokens) first")

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.layout.num_layers:
            raise SpecjaxError(f"layer {layer} is outside 0..{self.layout.num_layers - 1} of this store")

