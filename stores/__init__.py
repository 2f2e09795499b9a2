"""specjax.stores: prefix KV on SSD (TensorStore), radix index, reordering, device/host caches, prefetcher.

Knows nothing of models or evaluation: the model fingerprint is an opaque dict; KV arrives as arrays.
`caches` and `prefetch` import jax, so import them from their modules.
"""

from specjax.stores.errors import DiskFullError, ManifestError, StoreError, StoreMismatchError
from specjax.stores.index import StoreIndex
from specjax.stores.kvarray import K, PROBE, V, Layout
from specjax.stores.metrics import StoreMetrics
from specjax.stores.reads import ChunkReader
from specjax.stores.scheduler import Link
from specjax.stores.store import Gathered, KVStore, Locations, Match, PrefixWriter
from specjax.stores.writer import StoreWriter

__all__ = ["DiskFullError", "ManifestError", "StoreError", "StoreMismatchError", "K", "V", "PROBE", "Layout",
           "Link", "StoreMetrics", "Gathered", "KVStore", "Locations", "Match", "PrefixWriter", "StoreIndex",
           "ChunkReader", "StoreWriter"]
