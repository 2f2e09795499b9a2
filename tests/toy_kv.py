"""A toy model's prefix KV for the store tests that run several processes (crash, shared store): every vector is a
pure function of the tokens up to its position, as a real model's is, so any process can write or check any read."""

from __future__ import annotations

import zlib

import numpy as np

LAYOUT = {"num_layers": 2, "kv_heads": 2, "head_dim": 8, "probe_heads": 1, "chunk_tokens": 16}


def fingerprint(arch: str, kv_bits=()) -> dict:
    """A store fingerprint of the toy layout; `arch` keeps each test's stores apart; `kv_bits`: the low precisions it
    holds K and V at too."""
    return {"arch": arch, **LAYOUT, **({"kv_bits": list(kv_bits)} if kv_bits else {})}


def expected(store, match, layer: int, layer_kv, kind):
    """What a read of `kind` gives of one layer's (K, V, probe keys) at every position of `match`: the array, or its
    low-bit rows' bytes as the store encodes them. Low-bit K and its chunks' ranges are encoded from the chunks' keys
    as the store reads them whole (their other rows may be other prefixes' tokens), ranges over the rows that hold a
    token (`key_rows`)."""
    from specjax.kernels import quant
    from specjax.stores import Locations
    from specjax.stores.kvarray import K, K_RANGE, base_of, bits_of, in_chunk_range

    lay = store.layout
    if kind == K_RANGE or in_chunk_range(kind):
        loc = store.locate(match, np.arange(match.length), layer)
        chunks = np.unique(loc.chunks)
        ct = lay.chunk_tokens
        whole = store.read_locations(layer, K, Locations(np.repeat(chunks, ct), np.tile(np.arange(ct), len(chunks))))
        codes, ranges = quant.encode_key_chunks(whole.result().array, bits=bits_of(kind) or 8, chunk_tokens=ct,
                                                keys=key_rows(store, chunks))
        rows = np.searchsorted(chunks, loc.chunks) * ct + loc.offsets
        return (ranges if kind == K_RANGE else codes)[:, rows]
    x = layer_kv[base_of(kind)]
    if bits_of(kind) is None:
        return x
    return quant.encode_rows(x, bits=bits_of(kind), group=lay.group_channels)


def key_rows(store, chunks) -> np.ndarray:
    """bool [len(chunks) * chunk_tokens]: which rows of `chunks`, read whole, hold a token (not its segment's
    padding after its last token), from the store's segments."""
    ct = store.layout.chunk_tokens
    held = {}
    for seg in store.index.catalog.segments.values():
        if not seg.retired:
            held.update((seg.first_chunk + j, min(ct, seg.n_tokens - j * ct)) for j in range(seg.n_chunks))
    return (np.arange(ct)[None, :] < np.array([held[c] for c in chunks])[:, None]).ravel()


def kv_for(tokens) -> list:
    """Per layer (K [2, n, d], V [2, n, d], probe keys [1, n, d]) of the prefix `tokens`."""
    t = np.asarray(tokens, np.int64)
    shape = (LAYOUT["num_layers"], 5, LAYOUT["head_dim"])  # 5 heads: 2 K, 2 V, 1 probe
    rows = [np.random.default_rng(zlib.crc32(t[:p + 1].tobytes())).standard_normal(shape) for p in range(len(t))]
    a = np.stack(rows, axis=2).astype(np.float32) if rows else np.zeros(shape[:2] + (0, shape[2]), np.float32)
    return [(a[layer, 0:2], a[layer, 2:4], a[layer, 4:5]) for layer in range(LAYOUT["num_layers"])]


def read(store, match, layer: int, kind: int, positions=None):
    """Future of the `Gathered` vectors of `positions` (the match's order; default all) of one layer, as the engine's
    reads locate and read them."""
    positions = np.arange(match.length) if positions is None else positions
    return store.read_locations(layer, kind, store.locate(match, positions, layer))


def insert(store, tokens) -> None:
    """Store the prefix's KV unless the store holds all of it already."""
    tokens = np.asarray(tokens, np.int64)
    m = store.match(tokens)
    if m.length == len(tokens):
        m.close()
        return
    new = [tuple(x[:, m.length:] for x in layer) for layer in kv_for(tokens)]
    store.insert(tokens, new, base=m)
