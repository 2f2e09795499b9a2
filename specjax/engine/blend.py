"""CacheBlend and full KV reuse: a context of independently cached text chunks, reused wherever a request places
them (docs/systems.md; CacheBlend, EuroSys'25).

How a chunk's KV is precomputed follows the CacheBlend authors' reference (example/blend.py, where vLLM puts a
BOS before every chunk and the prompt): a context's first segment (the system-prompt header) is stored whole, as a
request computes it from position 0; every later chunk's KV is computed after a one-token sink prefix (the
model's BOS token, else its EOS token: what the model reads as a sequence start) so that the chunk's first token
is not itself computed as a sequence start (an attention sink). The store is an ordinary prefix store: the first
segment is stored under its own tokens, a later chunk under `sink + chunk` (its tokens at positions 1..len), so
every entry is the exact KV of its key from position 0, the same tokens in either role never share KV, and a
request reads only the chunk tokens' rows (the sink's own KV is not used). The store's fingerprint names the sink
(`chunk_sink`), and a store without it (the earlier protocol) is refused.

A request reads all its chunks' K/V per layer as one joined match, re-rotates every chunk's keys by (position in
the request - stored position) (RoPE is a rotation by position: rotating keys computed at p by delta gives the
keys at p + delta) and computes only some tokens of each layer, attending causally to the reused KV with the
recomputed rows scattered in:

- `full_reuse` computes the query only (the lower bound on quality: no chunk sees the chunks before it, only the
  sink);
- `cacheblend` computes every token on layers 0..CHECK_LAYER (layer 0's KV equals the reused KV exactly, since a
  RoPE model's layer-0 input is the position-free embedding, so deviation is first measured on layer 1), picks the
  context tokens whose values deviate most from the reused ones there, and on each later layer recomputes only
  those, keeping the most deviating of them for the next layer (the paper's gradual filtering). Two choices the
  paper and the authors' code make differently are settings of the system: the deviation that ranks tokens
  (`blend_deviation`: "value", as in the original vLLM-based code; "key", as in LMCache's blender; or their sum,
  the paper's "KV deviation") and whether later layers keep filtering (`blend_filter`: "gradual", the paper) or
  keep the check layer's set (`"fixed"`, both codebases).

The next layer's reads are requested before a layer computes, so loading layer i+1 overlaps computing layer i.
"""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sharding as sh
from specjax.connector import K, V
from specjax.engine import events
from specjax.engine import steps as S
from specjax.engine.engine import Engine, Prefill, fingerprint
from specjax.engine.clock import Clock
from specjax.engine.layer_io import LayerIO
from specjax.engine.policies import Blend, runs
from specjax.engine.types import LayerKV, LayerRecord
from specjax.errors import SpecjaxError
from specjax.kernels import SharedIndices
from specjax.models import transformer as T
from specjax.models.inference import bucket, padded

CHECK_LAYER = 1  # cacheblend computes layers 0..CHECK_LAYER in full and first selects on this one
FILTER_SPREAD = 0.25  # the schedule's ratios go from (1 + s) r down to (1 - s) r (s scaled down near r = 1)


def recompute_counts(num_layers: int, m: int, ratio: float, check_layer: int = CHECK_LAYER,
                     filtering: str = "gradual") -> list[int]:
    """Context tokens recomputed on each layer, out of m.

    ratio 0 (full KV reuse): none. Otherwise layers 0..check_layer recompute all m, and the later layers follow
    CacheBlend's gradual filtering: each recomputes a subset of the previous layer's tokens, the ratio falling
    linearly from r + s to r - s over those layers (mean r, the paper's "r1 slightly higher than r, r2 slightly
    less than r1, ..."), with s = FILTER_SPREAD * min(r, 1 - r) so that r = 1 recomputes everything.
    `filtering="fixed"`: every later layer recomputes the check layer's ceil(r m) tokens.
    """
    if ratio <= 0.0 or m == 0:
        return [0] * num_layers
    first = min(check_layer + 1, num_layers)
    if filtering == "fixed":
        return [m] * first + [min(m, math.ceil(ratio * m - 1e-9))] * (num_layers - first)
    spread = FILTER_SPREAD * min(ratio, 1.0 - ratio)
    span = max(num_layers - 1 - first, 1)
    counts = [m] * first
    for layer in range(first, num_layers):
        r = ratio + spread * (1.0 - 2.0 * (layer - first) / span)
        counts.append(min(m, math.ceil(r * m - 1e-9)))
    return counts


def chunk_sink(cfg) -> tuple[int, ...]:
    """The prefix every non-first chunk's KV is computed after: the BOS token, else EOS (the token a sequence
    starts from, as `Model.loglikelihood` starts an empty context); a model with neither is refused."""
    token = cfg.bos_token_id if cfg.bos_token_id is not None else cfg.eos_token_id
    if token is None:
        raise SpecjaxError(
            "cacheblend / full_reuse compute each text chunk's KV after the model's BOS (or EOS) token, so that "
            "the chunk's first token is not computed as a sequence start; this model's config has neither "
            "bos_token_id nor eos_token_id")
    return (int(token),)


def chunk_keys(chunks, sink) -> list[list[int]]:
    """Store key of each chunk of a context: the first segment itself (stored whole, as a request computes it),
    every later chunk after the sink (only its own tokens' KV is read, at stored positions len(sink)..)."""
    return [[int(t) for t in c] if i == 0 else [int(t) for t in sink] + [int(t) for t in c]
            for i, c in enumerate(chunks)]


def blend_fingerprint(model, chunk_tokens: int, kv_bits=()) -> dict:
    """The fingerprint of a cacheblend / full_reuse store: the model's (`kv_bits`: the low precisions it holds K and V
    at too), plus the chunk sink it was written with."""
    return {**fingerprint(model, chunk_tokens, kv_bits), "chunk_sink": list(chunk_sink(model.config))}


def reposition_keys(cfg, keys, shift):
    """Keys [H_kv, T, d] computed at positions p, moved to p + shift ([T] int): one more RoPE rotation, by the
    rotary table of the shifts (T.rotary), which a request computes once for all layers."""
    return T.rotate(keys, *T.rotary(cfg, shift))


def _distance(new, reused, rows):
    """Squared distance [C] between each row's recomputed vectors [H_kv, C, d] and its reused ones, over heads."""
    old = jnp.take(reused, rows, axis=1, mode="fill", fill_value=0)
    return jnp.square(new.astype(jnp.float32) - old.astype(jnp.float32)).sum((0, 2))


@functools.partial(jax.jit, static_argnums=(0, 8))
def _blend_layer(cfg, lp, h, rows, reused_k, reused_v, rotation, total, deviation="value"):
    """One layer over the computed rows of a request whose other tokens reuse cached KV.

    h [C, D]: hidden states of `rows` (int32 [C], request positions, ascending; padding rows hold the array
    length and are dropped); reused_k / reused_v [H_kv, S, d]: the chunks' stored KV in request order (keys still
    at their stored positions), rotation: the rotary table (T.rotary) of each token's position in the request
    minus its stored position;
    total: real tokens. Returns the next hidden states [C, D], the mixed keys and values attended to
    [H_kv, S, d], and each row's deviation [C]: the squared distance between its recomputed and reused values,
    keys (both at the request position) or both, summed over heads.

    The rows' own rotary table is computed here, not given (`T.Tokens.rotary`): the rows shrink from layer to layer.
    """
    keys = T.rotate(reused_k, *rotation)
    q, k, v = T.project(cfg, lp, h, rows)
    mixed_k = keys.at[:, rows].set(k.astype(keys.dtype), mode="drop")
    mixed_v = reused_v.at[:, rows].set(v.astype(reused_v.dtype), mode="drop")
    slots = jnp.arange(keys.shape[1])
    h = T.attend_and_mlp(cfg, lp, h, q, mixed_k, mixed_v, rows, slots, slots < total)
    value_dev = _distance(v, reused_v, rows) if deviation in ("value", "key_value") else 0.0
    key_dev = _distance(k, keys, rows) if deviation in ("key", "key_value") else 0.0
    return h, mixed_k, mixed_v, value_dev + key_dev


@jax.jit
def _rank(deviation, count):
    """Row indices by decreasing deviation among the first `count` rows (the rest after them)."""
    valid = jnp.arange(deviation.shape[0]) < count
    return jnp.argsort(jnp.where(valid, -deviation, jnp.inf), stable=True).astype(jnp.int32)


def _chunks(request) -> list[list[int]]:
    """A request's text chunks (its whole prefix as one where it names none)."""
    prefix = [int(t) for t in request.prefix]
    return [[int(t) for t in c] for c in request.chunks if len(c)] or ([prefix] if prefix else [])


def _placement(chunks: list[list[int]], keys: list[list[int]], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(the rotation of each of `size` token rows: its position in the request less its stored position; the chunk
    tokens' rows of the chunks' joined match, each chunk stored under `keys` (a later chunk's sink row not read))."""
    stored_at = [len(k) - len(c) for k, c in zip(keys, chunks)]  # stored position of each chunk's first token
    starts = np.cumsum([0] + [len(c) for c in chunks])[:-1]
    joined = np.cumsum([0] + [len(k) for k in keys])[:-1]
    shift = np.zeros(size, np.int32)
    for start, offset, c in zip(starts, stored_at, chunks):
        shift[start:start + len(c)] = start - offset
    read = np.concatenate([np.zeros(0, np.int64)] + [j + o + np.arange(len(c))
                                                      for j, o, c in zip(joined, stored_at, chunks)])
    return shift, read


def _loads(counts, m: int) -> list[bool]:
    """Per layer: does it read the reused KV (its attention uses some of it, or the next layer selects from it)?"""
    layers = len(counts)
    return [counts[i] < m or (i + 1 < layers and counts[i + 1] < counts[i]) for i in range(layers)]


def _keep_deviating(clock: Clock, deviation, keep: int, recomputed, rows, n: int, size: int, h):
    """The `keep` most deviating of the `recomputed` rows, with the n query rows: (recomputed, rows, rows on the
    device padded, h of those rows), ranked once the layer's deviation is computed (as `LayerIO.identify` paces
    identification)."""
    order = np.asarray(clock.timed("identify", _rank, clock.device_wait(deviation), len(recomputed)))
    kept = np.sort(order[:keep])  # rows of the most deviating tokens, in position order
    index = np.concatenate([kept, np.arange(len(rows) - n, len(rows))])
    rows = rows[index]
    rows_pad = bucket(len(rows))
    h = _gather_rows(h, jnp.asarray(padded(index, rows_pad, 0)))
    return recomputed[kept], rows, jnp.asarray(padded(rows, rows_pad, size)), h


def _context(layers_kv, size: int, total: int) -> list[LayerKV]:
    """The context a continuation attends to: every token's mixed K/V per layer (the computed rows are in it)."""
    context = SharedIndices(jnp.arange(size, dtype=jnp.int32), total)
    k = layers_kv[0][0]
    no_rows = jnp.zeros((k.shape[0], 0, k.shape[2]), k.dtype)
    return [LayerKV(k, v, context, no_rows, no_rows) for k, v in layers_kv]


@jax.jit
def _gather_rows(h, idx):
    return h[idx]


@runs(Blend)
class BlendEngine(Engine):
    """Runs `full_reuse` / `cacheblend` requests (`Request.chunks`) over a store of independently cached chunks."""

    def __init__(self, model, system, store, config=None, **kwargs):
        if not isinstance(system.schedule, Blend):
            raise SpecjaxError(f"system {system.name!r} is not a chunk-reuse system")
        if not model.config.uses_rope:
            raise SpecjaxError(
                f"system {system.name!r} moves cached keys to new positions by re-rotating them, which needs a "
                f"RoPE model; {model.name} ({model.config.arch}) encodes absolute positions in its embeddings. "
                f"Use a Llama / Qwen2 model, or a prefix-reuse system (as_full, spec, ...)")
        self.sink = chunk_sink(model.config)
        if store is not None and store.fingerprint.get("chunk_sink") != list(self.sink):
            raise SpecjaxError(
                f"system {system.name!r} stores each text chunk's KV computed after the sink {list(self.sink)}, "
                f"but the store at {store.where} was written with chunk_sink="
                f"{store.fingerprint.get('chunk_sink')!r} (none: chunks computed alone, the earlier protocol); "
                f"open a store with specjax.engine.blend.blend_fingerprint, in a new directory")
        super().__init__(model, system, store, *(() if config is None else (config,)), **kwargs)

    def prefill(self, request, reuse: bool, head: int, clock: Clock, opened) -> Prefill:
        """CacheBlend's schedule: every chunk's stored KV loaded per layer, re-rotated to the request's positions,
        and a share of the context tokens recomputed in it (none for full_reuse)."""
        if head:
            raise SpecjaxError(f"{self.system.name} computes no planned head of a stored prefix")
        if not reuse:  # a chunk failed its checksum: recompute the whole request as the engine does
            return super().prefill(request, reuse, head, clock, opened)
        cfg, params = self.cfg, self.model.params
        prefix, query = [int(t) for t in request.prefix], [int(t) for t in request.query]
        chunks = _chunks(request)
        if sum(chunks, []) != prefix:
            raise SpecjaxError("a request's chunks must concatenate to its prefix")
        if not query:
            raise SpecjaxError(f"{self.system.name} computes the query on reused chunk KV: a request needs "
                               f"query tokens")
        m, n = len(prefix), len(query)
        total = m + n
        size = bucket(total)
        keys = chunk_keys(chunks, self.sink)
        shift, read = _placement(chunks, keys, size)
        counts = recompute_counts(cfg.num_layers, m, self.system.schedule.ratio,
                                  filtering=self.system.schedule.filter)
        loads = _loads(counts, m)
        parts = [opened.enter_context(self._match_or_store(key)) for key in keys]
        match = opened.enter_context(self.store.join(parts))
        io = LayerIO(self.read_path(), match, m, size, clock, positions=read)
        opened.callback(io.close)
        io.plan_reads([layer for layer, load in enumerate(loads) if load])
        tokens = np.asarray(prefix + query, np.int32)
        recomputed = np.arange(counts[0]) if counts[0] == m else np.zeros(0, np.int64)
        rows = np.concatenate([recomputed, np.arange(m, total)])
        rows_pad = bucket(len(rows))
        rows_dev = jnp.asarray(padded(rows, rows_pad, size))
        h = T.embed_rows(cfg, params, padded(tokens[rows], rows_pad, 0), rows_dev, with_table=False).hidden
        zeros = jnp.zeros((cfg.num_kv_heads, size, cfg.head_dim), self.model.dtype)
        rotation = T.rotary_step(cfg, jnp.asarray(shift))  # see reposition_keys
        layers_kv, traced = [], []
        pace = sh.Pace(self.mesh, clock.device_wait)  # on a CPU mesh, a layer ahead at most (sharding.Pace)
        for layer, lp in enumerate(params["layers"]):
            traced.append(recomputed)
            if loads[layer]:
                reused_k, reused_v = io.take_all(layer, K), io.take_all(layer, V)
                io.let_go_certain(layer)
            else:
                reused_k = reused_v = zeros
            dispatched = time.monotonic()
            h, mixed_k, mixed_v, deviation = _blend_layer(cfg, lp, h, rows_dev, reused_k, reused_v,
                                                         rotation, total, self.system.schedule.deviation)
            clock.device_work(dispatched, h)  # the layer's compute, which the host goes on past
            for instead in events.emit("blend_layer", layer=layer, reused_k=reused_k, reused_v=reused_v,
                                       rotation=rotation, rows=rows_dev, deviation=deviation):
                deviation = deviation if instead is None else instead
            layers_kv.append((mixed_k, mixed_v))
            keep = counts[layer + 1] if layer + 1 < cfg.num_layers else len(recomputed)
            if keep < len(recomputed):
                recomputed, rows, rows_dev, h = _keep_deviating(clock, deviation, keep, recomputed, rows, n, size, h)
            pace.step(h)
        io.agree_on_bad_chunks()
        logits = clock.device_wait(S.head_row(cfg, params, h, len(rows) - 1))
        return Prefill(logits, _context(layers_kv, size, total), 0, reused_tokens=m,
                       computed_tokens=n + len(traced[-1]), layers=_layer_record(counts, loads, m),
                       prefetch=io.prefetch_report, then=[io.after_first_token], selections=traced)

    def stored_keys(self, request) -> list[list[int]]:
        """Each text chunk's key (`chunk_keys`): the store holds chunks, not the request's prefix."""
        return chunk_keys(_chunks(request), self.sink)

    def _match_or_store(self, key: list[int]):
        """The stored KV of a chunk's key (`chunk_keys`); one not stored yet is computed from position 0 and
        stored first (part of this TTFT)."""
        match = self.store.match(key)
        if match.length < len(key):
            match.close()
            self.warm(key)
            match = self.store.match(key)
        return match


def _layer_record(counts: list[int], loads: list[bool], m: int) -> LayerRecord:
    """Per layer: the reused share of the context (the rest recomputed), tokens read; no ITF measurements."""
    nan = [float("nan")] * len(counts)
    return LayerRecord(m, [1.0 - c / max(m, 1) for c in counts], [m if load else 0 for load in loads],
                       [c / max(m, 1) for c in counts], [False] * len(counts), nan, nan, nan)
