"""Prefix-KV reuse from Python: a store for a model, the engine of a system over it, and an explicit warm-up.

    import specjax
    model = specjax.load_model("smollm2-135m")
    store = specjax.open_store(model, "/tmp/kv")                      # made for this model's KV, or refused
    engine = specjax.prefill_engine(model, "spec", store, retention=0.25)
    engine.warm(prefix_ids)                                          # store the shared prefix's KV once
    specjax.warm_up(engine, [specjax.Request(prefix_ids, query_ids)])  # compile before timing anything
    result = engine.run(specjax.Request(prefix_ids, other_query_ids))  # reuses the stored prefix

`examples/serve_prefix.py` is a short serving loop over these.
"""

from __future__ import annotations

from specjax.compiles import CompileCounter
from specjax.engine import EngineConfig, Request, fingerprint, make_engine, make_system
from specjax.engine.blend import blend_fingerprint
from specjax.engine.policies import Blend
from specjax.errors import SpecjaxError
from specjax.stores import KVStore, Layout


def chunk_tokens_of(system: str | None = None, chunk_tokens: int | None = None) -> int:
    """The store chunk for `system`: `chunk_tokens` if given, else the one the system needs (contiguous_kv, cake),
    else the store layout's default."""
    if chunk_tokens is not None:
        return int(chunk_tokens)
    return (system is not None and make_system(system).chunk_tokens) or Layout.chunk_tokens


def open_store(model, location, *, system: str | None = None, chunk_tokens: int | None = None, kv_bits=(),
               **options) -> KVStore:
    """The KV store at `location` (a folder, or a TensorStore kvstore spec or URL) for `model`'s KV, created if it
    does not exist. It records whose KV it holds (the model's fingerprint: weights, tokenizer, shapes, dtype, chunk
    size) and a store made for another model, dtype or chunk size is refused with a message that says which.
    `system` picks the chunk size that system needs (`chunk_tokens_of`), and for cacheblend and full_reuse the
    fingerprint of their chunks' protocol (`blend.blend_fingerprint`: the sink they are written after); `kv_bits`:
    the low precisions (8, 4, 2) the store holds K and V at too, for systems that load at them (default: what
    `system` loads at, its `store_bits`; `prefill_engine(..., options={"kv_bits": 4})` needs kv_bits=(4,));
    `options`: `KVStore`'s (direct_io, read_only, disk_bandwidth, ...)."""
    built = make_system(system) if system is not None else None
    bits = kv_bits or (built.store_bits if built is not None else ())
    whose = blend_fingerprint if built is not None and isinstance(built.schedule, Blend) else fingerprint
    return KVStore.open(location, whose(model, chunk_tokens_of(system, chunk_tokens), bits), **options)


def prefill_engine(model, system: str, store: KVStore | None = None, *, options: dict | None = None, **config):
    """The prefill engine that runs `system` (a name of `specjax.engine.SYSTEMS`) over `store` (None: for recompute,
    which stores nothing). `options`: what a user may change about the system (`SystemOptions`' fields, e.g.
    {"alpha": 0.8}); `config`: `EngineConfig`'s fields (retention, gpu_cache_bytes, cpu_cache_bytes, ...).

    `engine.warm(prefix)` stores a prefix's KV; `engine.run(Request(prefix, query, continuations))` prefills a
    request, reusing what the store holds of its prefix, and returns a `RequestResult` (first-token logits, the
    continuations' log-probabilities, TTFT and its breakdown, I/O)."""
    built = make_system(system, **(options or {}))
    if built.reuse and store is None:
        raise SpecjaxError(f"system {system!r} reuses stored KV: give it a store (specjax.open_store)")
    return make_engine(model, built, store if built.reuse else None, EngineConfig(**config))


def warm_up(engine, requests) -> int:
    """Run `requests` once each, untimed, so that every device program they need is compiled (and the caches see
    them); returns how many programs compiled. Requests of the same shapes later compile nothing
    (`specjax.engine.shape_key`: the same stored prefix, new tokens and longest continuation in the same buckets)."""
    with CompileCounter() as compiles:
        for request in requests:
            engine.run(request)
    return compiles.count


__all__ = ["Request", "chunk_tokens_of", "open_store", "prefill_engine", "warm_up"]
