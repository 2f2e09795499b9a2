"""The prefill engine: one request's layer loop over reused prefix KV (design.md section 3).

Device work is the pure jitted steps of `specjax.models.transformer` and `specjax.kernels`; the host loop
only moves indices and bytes: it asks the prefetcher for what a layer needs, starts reads for the next layer
before computing this one, and writes the new prefix tokens' KV behind. A `System` decides what each layer
loads; the loop is the same for all of them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.engine import state as st
from specjax.engine.speculation import Speculator
from specjax.engine.systems import System
from specjax.errors import SpecjaxError
from specjax.kernels import PerHeadIndices, SharedIndices, gathered_attention, probe_scores
from specjax.models import transformer as T
from specjax.models.inference import bucket, log_softmax
from specjax.stores import K, PROBE, V, KVStore
from specjax.stores.caches import TieredCache
from specjax.stores.prefetch import Prefetcher


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    retention: float = 0.25  # fraction of the reused prefix kept per layer (k = ceil(r * |R|))
    gpu_cache_bytes: int = 0
    cpu_cache_bytes: int = 0
    pcie_bandwidth: float | None = None  # bytes/s of emulated host->device copies (None: not throttled)
    kernel_impl: str = "auto"  # kernels: "auto" (Pallas on GPU), "pallas", "reference"
    reorder_every: int = 0  # run a reordering pass after every N requests (systems with reorder); 0: never
    cake_chunk_tokens: int = 512  # cake: tokens per chunk of its compute / load schedule (a multiple of the store's)
    # chunked prefill: with no reused prefix (recompute, a cold request), more new tokens than this are computed
    # in chunks of this many, each attending to the earlier chunks' KV (exact); 0: one block, as the plain forward
    # (attention is blocked, so one block never holds a [heads, tokens, tokens] score tensor)
    prefill_chunk_tokens: int = 0
    trace: bool = False  # keep every layer's selected token sets in the result (tests, analysis)


@dataclasses.dataclass
class Request:
    prefix: list[int]  # shared prefix (system prompt); its KV is stored and reused
    query: list[int]  # the request's own tokens; computed, never stored
    continuations: list[list[int]] = dataclasses.field(default_factory=list)  # scored against the same KV
    # the prefix as independently cached text chunks (CacheBlend, full KV reuse); empty: one prefix
    chunks: list[list[int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RequestResult:
    first_token_logits: np.ndarray  # fp32 [vocab]: logits after prefix + query
    continuation_logprobs: list[tuple[float, bool]]  # (sum logprob, greedy) per continuation
    ttft_ms: float
    breakdown_ms: dict[str, float]  # probe_io, identify, kv_io_stall, compute
    reused_tokens: int
    computed_tokens: int
    io: dict  # store metrics accumulated during the request (disk bytes, chunks, hits, ...)
    layers: dict  # per-layer lists: retained, fallback, jaccard, threshold
    prefetch: dict  # prefetched / used / hit token counts (speculative prefetch)
    recomputed_bad_chunks: bool = False
    selections: list | None = None  # with EngineConfig.trace: per layer, int arrays [heads or 1, k] of R positions
    split: dict | None = None  # cake: where computing from the front met loading from the back (see engine.cake)


def fingerprint(model, chunk_tokens: int) -> dict:
    """What a store must agree on with the model that reads it."""
    c = model.config
    return {"arch": c.arch, "num_layers": c.num_layers, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "dtype": jnp.dtype(model.dtype).name,
            "chunk_tokens": chunk_tokens, "probe_heads": len(probe_kv_heads(c))}


def probe_query_heads(cfg, count: int = 3) -> tuple[int, ...]:
    """The first `count` query heads (SPEC: which ones does not matter). With grouped-query attention they
    share as few KV heads as possible, so the probe keys read are fewest (design 4.2)."""
    return tuple(range(min(count, cfg.num_heads)))


def probe_kv_heads(cfg, count: int = 3) -> tuple[int, ...]:
    group = cfg.num_heads // cfg.num_kv_heads
    return tuple(sorted({h // group for h in probe_query_heads(cfg, count)}))


class _BadChunk(Exception):
    """A chunk failed its checksum: this request's reuse is abandoned and it is recomputed."""


class _Clock:
    """Splits a request's wall time into the TTFT breakdown phases."""

    def __init__(self):
        self.start = time.perf_counter()
        self.ms = {"probe_io": 0.0, "identify": 0.0, "kv_io_stall": 0.0}

    def timed(self, phase: str, fn, *args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        if phase == "identify":
            jax.block_until_ready(out)
        self.ms[phase] += (time.perf_counter() - t) * 1e3
        return out

    def finish(self) -> tuple[float, dict]:
        ttft = (time.perf_counter() - self.start) * 1e3
        return ttft, dict(self.ms, compute=max(0.0, ttft - sum(self.ms.values())))


# ---- jitted device steps -----------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _project(cfg, lp, h, positions):
    return T.project(cfg, lp, h, positions)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("impl",))
def _finish(cfg, lp, h, q, own_k, own_v, prefix_k, prefix_v, selection, q_len, *, impl):
    attn = gathered_attention(q, prefix_k, prefix_v, own_k, own_v, selection, q_len=q_len, impl=impl,
                              check_indices=False)
    return T.output_and_mlp(cfg, lp, h, attn)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("self_causal",))
def _finish_plain(cfg, lp, h, q, keys, values, positions, visible, *, self_causal=False):
    """A layer's tail when nothing is reused: its tokens (at `positions`) attend causally to rows [0, visible) of
    keys / values [H_kv, W, d], row i holding position i, through the model's own attention (as the plain forward)."""
    slots = jnp.arange(keys.shape[1], dtype=jnp.int32)
    return T.attend_and_mlp(cfg, lp, h, q, keys, values, positions, slots, slots < visible, self_causal=self_causal)


@functools.partial(jax.jit, static_argnames=("kv_head_of_probe", "impl", "q_heads", "kv_heads"))
def _scores(q, prefix_k, own_k, prefix_len, q_len, *, kv_head_of_probe, impl, q_heads=None, kv_heads=None):
    """Scores of the prefix keys from query heads `q_heads` of q (None: all), each against KV head
    kv_head_of_probe[i] of prefix_k and of own_k's heads `kv_heads` (None: all); the heads are taken inside the
    jitted step, so a probe layer dispatches no gather of its own."""
    if q_heads is not None:
        q = q[np.asarray(q_heads)]
    if kv_heads is not None:
        own_k = own_k[np.asarray(kv_heads)]
    return probe_scores(q, prefix_k, own_k, kv_head_of_probe=kv_head_of_probe, prefix_len=prefix_len,
                        q_len=q_len, impl=impl)


def _put(buf, rows, start):
    return jax.lax.dynamic_update_slice_in_dim(buf, rows.astype(buf.dtype), start, axis=1)


@functools.partial(jax.jit, donate_argnums=0)
def _put_rows(buf, rows, start):
    """buf [H, M, d] with rows [H, C, d] written at token `start`, in place."""
    return _put(buf, rows, start)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _zero_buffers(count: int, shape: tuple, dtype):
    return [jnp.zeros(shape, dtype) for _ in range(count)]


@functools.partial(jax.jit, static_argnums=0)
def _head_row(cfg, params, h, row):
    return T.head(cfg, params, jax.lax.dynamic_slice_in_dim(h, row, 1))[0]


@jax.jit
def _scatter_tokens(like, idx, rows):
    """Zeros shaped like `like` [heads, M, d] with rows[:, i] at token idx[i] (idx >= M is padding, dropped)."""
    return jnp.zeros_like(like).at[:, idx].set(rows.astype(like.dtype), mode="drop")


@jax.jit
def _gather_tokens(x, idx):
    """x [heads, M, d] rows at idx (positions >= M are padding and give zeros)."""
    return jnp.take(x, idx, axis=1, mode="fill", fill_value=0)


@dataclasses.dataclass
class _LayerKV:
    """What one layer's attention saw: prefix arrays + selection, and the computed tokens' own K/V."""

    prefix_k: jax.Array
    prefix_v: jax.Array
    selection: object
    own_k: jax.Array
    own_v: jax.Array


class Engine:
    """Runs requests for one system over one store; owns that system's caches and prefetcher."""

    def __init__(self, model, system: System, store: KVStore | None, config: EngineConfig = EngineConfig()):
        if system.reuse and store is None:
            raise SpecjaxError(f"system {system.name!r} reuses prefix KV and needs a store")
        if config.prefill_chunk_tokens < 0:
            raise SpecjaxError(f"prefill_chunk_tokens must be >= 0 (0: one block), got {config.prefill_chunk_tokens}")
        if not 0.0 < config.retention <= 1.0:
            raise SpecjaxError(f"retention must be in (0, 1], got {config.retention}")
        if store is not None and system.chunk_tokens and store.layout.chunk_tokens != system.chunk_tokens:
            raise SpecjaxError(f"system {system.name!r} reads {system.chunk_tokens}-token chunks but the store "
                               f"holds {store.layout.chunk_tokens}-token chunks; give it a store of its own")
        self.model, self.cfg, self.system, self.store, self.config = model, model.config, system, store, config
        probe_q = probe_query_heads(self.cfg, system.num_probe_heads)
        probe_kv = probe_kv_heads(self.cfg, system.num_probe_heads)
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        self.kv_of_probe = tuple(probe_kv.index(h // group) for h in probe_q)
        self.probe_q, self.probe_kv = np.asarray(probe_q), np.asarray(probe_kv)
        self.kv_of_head = tuple(h // group for h in range(self.cfg.num_heads))
        self.cache = self.prefetcher = self.speculator = None
        self.requests_run = 0
        # what the new tokens attend to when nothing comes before them: 16 zero rows, none selected
        self._no_prefix = jnp.zeros((self.cfg.num_kv_heads, 16, self.cfg.head_dim), model.dtype)
        self._no_selection = SharedIndices(jnp.arange(16, dtype=jnp.int32), 0)
        if store is not None:
            self.cache = TieredCache(config.gpu_cache_bytes, config.cpu_cache_bytes, system.cache_policy,
                                     metrics=store.metrics, pcie_bandwidth=config.pcie_bandwidth)
            self.prefetcher = Prefetcher(store, self.cache)
            if system.prefetch == "speculative":
                self.speculator = Speculator(store, self.cache)

    # -- storing prefixes ------------------------------------------------------------------------

    def warm(self, prefix) -> bool:
        """Store a prefix's exact KV (plain forward) unless it is stored already; True if it wrote."""
        prefix = [int(t) for t in prefix]
        match = self.store.match(prefix)
        if match.length == len(prefix):
            match.close()
            return False
        writer = self.store.begin_insert(prefix, base=match)
        n = len(prefix)
        ids = np.zeros(bucket(n), np.int32)
        ids[:n] = prefix
        positions = jnp.arange(len(ids), dtype=jnp.int32)
        h = T.embed_step(self.cfg, self.model.params, jnp.asarray(ids), positions)
        start = match.length
        with writer:
            for layer, lp in enumerate(self.model.params["layers"]):
                h, k, v = T.self_attention_layer(self.cfg, lp, h, positions, positions < n)
                writer.write_layer(layer, k[:, start:n], v[:, start:n], k[self.probe_kv, start:n])
            writer.commit()
        return True

    # -- one request -----------------------------------------------------------------------------

    def run(self, request: Request) -> RequestResult:
        if not request.prefix and not request.query:
            raise SpecjaxError("a request needs at least one token")
        before = self.store.metrics.snapshot() if self.store is not None else None
        try:
            result = self._run(request, reuse=self.system.reuse)
        except _BadChunk:
            result = self._run(request, reuse=False)
            result.recomputed_bad_chunks = True
        if before is not None:
            after = self.store.metrics.snapshot()
            result.io = {k: after[k] - before[k] for k in before if not k.endswith(("_ratio", "amplification"))}
        self.requests_run += 1
        if self.system.reorder and self.config.reorder_every and self.requests_run % self.config.reorder_every == 0:
            self.reorder()
        return result

    def reorder(self) -> int:
        """Repack every radix node whose importance has been observed (SPEC's KV reordering)."""
        from specjax.stores.reorder import Reorderer

        return Reorderer(self.store).run_once()

    def _run(self, request: Request, *, reuse: bool) -> RequestResult:
        clock = _Clock()
        cfg, system = self.cfg, self.system
        tokens = [int(t) for t in request.prefix] + [int(t) for t in request.query]
        match = self.store.match(request.prefix) if reuse else None
        m = match.length if match is not None else 0
        n, new_prefix = len(tokens) - m, len(request.prefix) - m
        m_pad = bucket(max(m, 1))
        k = min(m, max(1, math.ceil(self.config.retention * m))) if system.prunes else m
        k_cap = bucket(max(k, 1))
        state = st.ImportanceState.init(cfg.num_layers, m_pad)
        writer = self.store.begin_insert(request.prefix, base=match) if reuse and new_prefix > 0 else None
        io = _LayerIO(self, match, m, m_pad, clock)
        try:
            if m == 0 and 0 < self.config.prefill_chunk_tokens < n:
                logits, layers_kv = self._prefill_chunked(tokens, writer, new_prefix)
                importance, traced = [], []
                own_tokens = 0  # the computed tokens' KV is the layers' buffers, as for a reused prefix
            else:
                logits, layers_kv, state, importance, traced = self._prefill_block(
                    io, m, n, k, k_cap, state, tokens, writer, new_prefix)
                own_tokens = n
            ttft, breakdown = clock.finish()
            # After the first token: importance feedback for reordering, then the write-behind commit.
            if importance:
                self.store.record_importance(match, np.stack(importance))
            if writer is not None:
                writer.commit()  # also releases `match`, which the writer owns
                writer = match = None
        finally:
            io.close()
            if writer is not None:
                writer.abort()
            if match is not None:
                match.close()
        first = np.asarray(logits, np.float32)
        contexts = [_context_for_continuation(kv, own_tokens) for kv in layers_kv] if request.continuations else []
        conts = [self._score(contexts, first, m, n, c) for c in request.continuations]
        return RequestResult(
            first_token_logits=first, continuation_logprobs=conts, ttft_ms=ttft, breakdown_ms=breakdown,
            reused_tokens=m, computed_tokens=n, io={}, layers=_layer_report(state, m), prefetch=io.prefetch_report(),
            selections=traced if self.config.trace else None)

    def _prefill_block(self, io, m, n, k, k_cap, state, tokens, writer, new_prefix):
        """The n new tokens as one block over the (selected) reused prefix, layer by layer:
        (first-token logits, per-layer KV, state, importance per layer, traced selections)."""
        cfg, params = self.cfg, self.model.params
        n_pad = bucket(n)
        if m:
            io.prefetch_first()
            io.read_ahead(1)
        ids = np.zeros(n_pad, np.int32)
        ids[:n] = tokens[m:]
        positions = jnp.arange(m, m + n_pad, dtype=jnp.int32)
        h = T.embed_step(cfg, params, jnp.asarray(ids), positions)
        layers_kv, importance, traced = [], [], []
        for layer, lp in enumerate(params["layers"]):
            q, own_k, own_v = _project(cfg, lp, h, positions)
            if m == 0:  # nothing reused: the plain forward's layer
                prefix_k = prefix_v = self._no_prefix
                selection = self._no_selection
                h = _finish_plain(cfg, lp, h, q, own_k, own_v, positions, n, self_causal=True)
            else:
                state, prefix_k, prefix_v, selection, imp, chosen = self._select(
                    io, state, layer, q, own_k, n, k, k_cap)
                importance.append(imp)
                traced.append(chosen)
                h = _finish(cfg, lp, h, q, own_k, own_v, prefix_k, prefix_v, selection, n,
                            impl=self.config.kernel_impl)
            if m:
                # Dispatched: the next layer's reads are issued while the device computes this one.
                io.after_selection(layer, np.unique(chosen))
            layers_kv.append(_LayerKV(prefix_k, prefix_v, selection, own_k, own_v))
            if writer is not None:
                writer.write_layer(layer, own_k[:, :new_prefix], own_v[:, :new_prefix],
                                   own_k[self.probe_kv, :new_prefix])
        logits = _head_row(cfg, params, h, n - 1).block_until_ready()
        return logits, layers_kv, state, importance, traced

    # -- chunked prefill (nothing reused) ----------------------------------------------------------------

    def _prefill_layer(self, lp, h, positions, keys, values, lo: int, count: int):
        """One layer of a chunk of new tokens at token `lo` (`count` valid rows): its K/V rows are written into this
        layer's buffers keys / values [H_kv, W, d], and it attends causally to rows [0, lo + count) of them.
        Returns (next hidden, keys, values)."""
        q, own_k, own_v = _project(self.cfg, lp, h, positions)
        keys, values = _put_rows(keys, own_k, lo), _put_rows(values, own_v, lo)
        return _finish_plain(self.cfg, lp, h, q, keys, values, positions, lo + count), keys, values

    def _prefill_chunked(self, tokens, writer, new_prefix):
        """Chunked prefill of all tokens (none reused): chunk by chunk through every layer, each chunk's K/V
        written into per-layer buffers that later chunks attend to. The writer gets a layer's new prefix KV
        as soon as the last chunk has passed that layer. (first-token logits, per-layer KV)."""
        cfg, params, c = self.cfg, self.model.params, self.config.prefill_chunk_tokens
        n = len(tokens)
        n_chunks = -(-n // c)
        width = n_chunks * c  # whole chunks, so no write is clipped
        shape = (cfg.num_kv_heads, width, cfg.head_dim)
        keys = _zero_buffers(cfg.num_layers, shape, self._no_prefix.dtype)
        values = _zero_buffers(cfg.num_layers, shape, self._no_prefix.dtype)
        for j in range(n_chunks):
            lo = j * c
            count = min(c, n - lo)
            size = min(c, bucket(count))  # a partial last chunk is padded only to its bucket
            ids = np.zeros(size, np.int32)
            ids[:count] = tokens[lo:lo + count]
            positions = jnp.asarray(np.arange(lo, lo + size, dtype=np.int32))
            h = T.embed_step(cfg, params, jnp.asarray(ids), positions)
            for layer, lp in enumerate(params["layers"]):
                h, keys[layer], values[layer] = self._prefill_layer(lp, h, positions, keys[layer], values[layer],
                                                                    lo, count)
                if writer is not None and j == n_chunks - 1:
                    writer.write_layer(layer, keys[layer][:, :new_prefix], values[layer][:, :new_prefix],
                                       keys[layer][self.probe_kv, :new_prefix])
        logits = _head_row(cfg, params, h, count - 1).block_until_ready()
        selection = SharedIndices(jnp.asarray(np.arange(width, dtype=np.int32)), n)
        return logits, [_LayerKV(keys[i], values[i], selection, keys[i][:, :0], values[i][:, :0])
                        for i in range(cfg.num_layers)]

    # -- choosing and loading a layer's prefix KV --------------------------------------------------

    def _select(self, io: "_LayerIO", state, layer, q, own_k, n, k, k_cap):
        """(state, prefix_k, prefix_v, selection, importance of R [m], chosen positions of R [1 or H, k])."""
        system, impl, m, m_pad = self.system, self.config.kernel_impl, io.m, io.m_pad
        if system.identify == "chunks":
            return self._select_chunks(io, state, layer, q, own_k, n, k)
        if system.identify == "none":
            keys, values = io.take_all(layer, K), io.take_all(layer, V)
            sel = SharedIndices(jnp.arange(m_pad, dtype=jnp.int32), m)
            state = st.record_union(state, layer, jnp.arange(m_pad, dtype=jnp.int32), m)
            return state, keys, values, sel, np.ones(m, np.float32), np.arange(m)[None]
        if system.identify == "itf":
            probe_k = io.take_all(layer, PROBE, phase="probe_io")
            scores = io.clock.timed("identify", _scores, q, probe_k, own_k, m, n, kv_head_of_probe=self.kv_of_probe,
                                    impl=impl, q_heads=tuple(map(int, self.probe_q)),
                                    kv_heads=tuple(map(int, self.probe_kv)))
            state, shared, use_shared = io.clock.timed(
                "identify", st.itf_select, state, layer, scores, k, m, system.alpha, k_cap=k_cap)
            importance = _normalised_importance(scores, m)
            if bool(use_shared):
                chosen = np.asarray(shared)[:k]
                io.identified(layer, chosen)
                keys, values = io.take(layer, K, chosen, k_cap), io.take(layer, V, chosen, k_cap)
                selection = SharedIndices(jnp.arange(k_cap, dtype=jnp.int32), k)
                return state, keys, values, selection, importance, chosen[None]
        if system.identify not in ("h2o", "itf"):  # ITF's fallback is H2O; Systems refuse unknown modes
            raise SpecjaxError(f"the layer loop cannot identify with {system.identify!r}")
        # Per-head H2O: every head's scores from all keys, then the values of each head's top-k.
        keys = io.take_all(layer, K)
        scores = io.clock.timed("identify", _scores, q, keys, own_k, m, n, kv_head_of_probe=self.kv_of_head,
                                impl=impl)
        state, per_head = io.clock.timed("identify", st.per_head_select, state, layer, scores, k, m, k_cap=k_cap)
        chosen = np.asarray(per_head)[:, :k]
        union = np.unique(chosen)
        io.identified(layer, union, kinds=(V,))
        state = st.record_union(state, layer, jnp.asarray(_pad_np(union, m_pad)), len(union))
        union_pad = bucket(len(union))
        values = _scatter_tokens(keys, jnp.asarray(_pad_np(union, union_pad, fill=m_pad)),
                                 io.take(layer, V, union, union_pad))
        importance = _normalised_importance(scores, m)
        return state, keys, values, PerHeadIndices(per_head, k), importance, chosen

    def _select_chunks(self, io: "_LayerIO", state, layer, q, own_k, n, k):
        """ContiguousKV (design 4.6): a period's first layer scores every head on all keys and keeps the best
        whole chunks; the period's other layers reuse that set from the state and find it prefetched."""
        c, m, m_pad = self.store.layout.chunk_tokens, io.m, io.m_pad
        first = layer - layer % self.system.period_layers
        n_chunks = -(-k // c)
        k_cap = min(bucket(n_chunks * c), m_pad)
        if layer == first:
            keys = io.take_all(layer, K)
            scores = io.clock.timed("identify", _scores, q, keys, own_k, m, n, kv_head_of_probe=self.kv_of_head,
                                    impl=self.config.kernel_impl)
            state, positions, count, importance = io.clock.timed(
                "identify", st.chunk_select, state, layer, scores, n_chunks, m, chunk_tokens=c,
                chunk_cap=bucket(n_chunks, minimum=4), k_cap=k_cap)
            chosen, io.period_importance = np.asarray(positions)[: int(count)], np.asarray(importance)[:m]
            io.credit(layer, K, chosen)
            io.plan_period(layer, chosen)
            keys = _gather_tokens(keys, positions)
        else:
            state = st.reuse_selection(state, layer, first)
            chosen = np.asarray(state.selected[layer])[: int(state.count[layer])]
            keys = io.take(layer, K, chosen, k_cap, importance=io.period_importance[chosen])
        values = io.take(layer, V, chosen, k_cap, importance=io.period_importance[chosen])
        selection = SharedIndices(jnp.arange(k_cap, dtype=jnp.int32), len(chosen))
        return state, keys, values, selection, io.period_importance, chosen[None]

    # -- continuation scoring against the same (pruned) KV ----------------------------------------

    def _score(self, contexts: list[tuple], first_logits, m, n, continuation) -> tuple[float, bool]:
        """(sum logprob, greedy) of a continuation attending to each layer's context (prefix selection + computed)."""
        cfg, params = self.cfg, self.model.params
        cont = [int(t) for t in continuation]
        if not cont:
            raise SpecjaxError("cannot score an empty continuation")
        c = len(cont)
        c_pad = bucket(c, minimum=8)
        ids = np.zeros(c_pad, np.int32)
        ids[:c] = cont
        positions = jnp.arange(m + n, m + n + c_pad, dtype=jnp.int32)
        h = T.embed_step(cfg, params, jnp.asarray(ids), positions)
        for lp, (prefix_k, prefix_v, selection) in zip(params["layers"], contexts):
            q, own_k, own_v = _project(cfg, lp, h, positions)
            h = _finish(cfg, lp, h, q, own_k, own_v, prefix_k, prefix_v, selection, c,
                        impl=self.config.kernel_impl)
        logits = np.concatenate([first_logits[None], np.asarray(T.head_step(cfg, params, h))[: c - 1]], 0)
        logprobs = log_softmax(logits)  # on the host: no device program per continuation length
        target = np.asarray(cont)
        return float(logprobs[np.arange(c), target].sum()), bool((logits.argmax(-1) == target).all())


def _pad_np(x: np.ndarray, size: int, fill: int = -1) -> np.ndarray:
    out = np.full(size, fill, np.int32)
    out[: len(x)] = x
    return out


def _normalised_importance(scores, m: int) -> np.ndarray:
    """Per-token importance of R averaged over heads, each head normalised to sum 1 (for reordering)."""
    s = np.asarray(scores, np.float64)[:, :m]
    return (s / np.maximum(s.sum(1, keepdims=True), 1e-30)).mean(0).astype(np.float32)


@functools.partial(jax.jit, static_argnums=2)
def _join(prefix, own, width: int):
    """[H, M, d] and [H, n, d] side by side, zero-padded to `width` tokens."""
    joined = jnp.concatenate([prefix, own], axis=1)
    return jnp.pad(joined, ((0, 0), (0, width - joined.shape[1]), (0, 0)))


def _context_for_continuation(kv: _LayerKV, n: int):
    """Prefix arrays + selection for tokens after the computed ones: the computed tokens join the selection.

    The arrays are padded to a bucket of their joint width and the selection to that same width, so scoring a
    continuation compiles once per (continuation bucket, context bucket), not per combination of the prefix's,
    the computed tokens' and the selection's sizes."""
    M = kv.prefix_k.shape[1]
    width = bucket(M + kv.own_k.shape[1])
    keys, values = _join(kv.prefix_k, kv.own_k, width), _join(kv.prefix_v, kv.own_v, width)
    own = np.arange(M, M + n, dtype=np.int32)
    sel = kv.selection
    count = int(np.max(np.asarray(sel.count))) if sel.count is not None else sel.idx.shape[-1]
    rows = np.atleast_2d(np.asarray(sel.idx))[:, :count]
    idx = np.concatenate([rows, np.broadcast_to(own, (rows.shape[0], n))], axis=1)
    padded = np.zeros((idx.shape[0], width), np.int32)
    padded[:, : idx.shape[1]] = idx
    if isinstance(sel, PerHeadIndices):
        return keys, values, PerHeadIndices(jnp.asarray(padded), idx.shape[1])
    return keys, values, SharedIndices(jnp.asarray(padded[0]), idx.shape[1])


def _layer_report(state: st.ImportanceState, m: int) -> dict:
    retained = np.asarray(state.retained)
    loaded = np.asarray(state.count) / max(m, 1)
    return {
        "retained": np.where(np.isnan(retained), loaded, retained).tolist(),
        "fallback": np.asarray(state.fallback).tolist(),
        "jaccard": np.asarray(state.jaccard).tolist(),
        "threshold": np.asarray(state.threshold).tolist(),
        "loaded_tokens": np.asarray(state.count).tolist(),
        "prefix_tokens": m,
    }


class _LayerIO:
    """One request's reads through the prefetcher: what is requested ahead, what is taken, and timing."""

    def __init__(self, engine: Engine, match, m: int, m_pad: int, clock: _Clock, positions=None):
        """`positions`: the m match positions the request reads, in order (default: 0..m-1)."""
        self.engine, self.match, self.m, self.m_pad, self.clock = engine, match, m, m_pad, clock
        self.all_positions = np.arange(m) if positions is None else np.asarray(positions, np.int64)
        self.prefetched: dict[int, np.ndarray] = {}
        self.stats = {"prefetched": 0, "used": 0, "hit": 0}
        self.period_importance: np.ndarray | None = None  # "chunks": token importance [m] the period chose by
        self._window_opened: dict[int, float] = {}  # layer -> when its speculation was issued
        self._located: dict[int, np.ndarray] = {}  # layer -> chunk of each of all_positions (_chunks_of_all)

    # what the system reads for a layer before it is needed
    def _request_ahead(self, layer: int, previous: np.ndarray | None) -> None:
        pf, kind = self.engine.prefetcher, self.engine.system.prefetch
        if layer >= self.engine.cfg.num_layers or kind == "none":
            return
        if kind == "periods":
            if previous is None:  # the first period's keys; plan_period reads ahead for every later layer
                pf.request(self.match, layer, K, self.all_positions)
            return
        self._request_certain(layer, speculative=False)

    def _request_certain(self, layer: int, *, speculative: bool) -> None:
        """Request what `layer` reads whatever it selects (the identification's certain reads), for systems that
        prefetch them."""
        if self.engine.system.prefetch in ("none", "periods"):
            return
        for kind in self.engine.system.certain_reads:
            self.engine.prefetcher.request(self.match, layer, kind, self.all_positions, speculative=speculative)

    def _speculate(self, layer: int, previous: np.ndarray) -> np.ndarray:
        """Positions whose K/V to read ahead for `layer`: every token of the chunks the speculator picks from the
        previous layer's important set (specjax.engine.speculation)."""
        chunks = self.engine.speculator.chunks(self.match, layer, previous)
        return self.all_positions[np.isin(self._chunks_of_all(layer), chunks)]

    def _chunks_of_all(self, layer: int) -> np.ndarray:
        """The chunk of each of the request's positions at `layer`, located once: speculation for the layer and
        the record of what it needed both use it."""
        if layer not in self._located:
            self._located[layer] = self.engine.store.locate(self.match, self.all_positions, layer).chunks
        return self._located[layer]

    def prefetch_first(self, layer: int = 0) -> None:
        self._request_ahead(layer, None)

    def read_ahead(self, layer: int) -> None:
        """Issue, at speculative priority, the reads `layer` needs whatever it selects, one layer before they are
        asked for on demand: an emulated disk then moves them whenever no demand read waits, rather than idling
        while the host works, and the demand request later expedites them. Every system with such reads gets
        this alike; selections themselves are never read this far ahead."""
        if layer < self.engine.cfg.num_layers:
            self._request_certain(layer, speculative=True)

    def plan_period(self, first: int, chosen: np.ndarray) -> None:
        """ContiguousKV's reads once a period's first layer chose its chunks (design 4.6).

        Intra-period: the set's K/V for every layer of the period, waiting only until the first `sp` layers
        have arrived. Inter-period: the next period's first-layer keys, and this set speculatively for the
        next period's layers; once that period chooses its own set only the difference is read.
        """
        pf, system, num_layers = self.engine.prefetcher, self.engine.system, self.engine.cfg.num_layers
        p, sp = system.period_layers, system.subperiod_layers
        tickets = []
        for layer in range(first, min(first + p, num_layers)):
            for kind in (V,) if layer == first else (K, V):
                ticket = pf.request(self.match, layer, kind, chosen)
                if layer < first + sp:
                    tickets.append(ticket)
        following = first + p
        if following < num_layers:
            pf.request(self.match, following, K, self.all_positions)
            for layer in range(following, min(following + p, num_layers)):
                for kind in (V,) if layer == following else (K, V):
                    pf.request(self.match, layer, kind, chosen, speculative=True)
                self.prefetched[layer] = chosen
        self.clock.timed("kv_io_stall", pf.wait, tickets)

    def credit(self, layer: int, kind: int, positions: np.ndarray) -> None:
        """Feed the period's importance of `positions` to their cached chunks without reading them again."""
        cache = self.engine.cache
        if cache is None or self.period_importance is None:
            return
        chunks = self.engine.store.locate(self.match, positions, layer).chunks
        for chunk in np.unique(chunks):
            importance = self.period_importance[positions[chunks == chunk]].sum()
            cache.feedback((layer, kind, int(chunk)), importance=float(importance))

    def identified(self, layer: int, chosen: np.ndarray, kinds=(K, V)) -> None:
        """The layer's important set is known, before its `kinds` are taken: with speculative prefetch, its reads
        are queued (demand first), then the next layer's guess from it, so the disk reads that guess during this
        layer's own stall and compute, not only after them. A guess read whose chunk the next layer does not
        need is withdrawn there unless the disk has already taken it."""
        speculator = self.engine.speculator
        following = layer + 1
        if speculator is None or following >= self.engine.cfg.num_layers or not len(chosen):
            return
        for kind in kinds:
            self.engine.prefetcher.request(self.match, layer, kind, chosen)
        self._window_opened[following] = time.perf_counter()
        guess = self._speculate(following, chosen)
        for kind in (K, V):
            self.engine.prefetcher.request(self.match, following, kind, guess, speculative=True)
        self.prefetched[following] = guess

    def after_selection(self, layer: int, chosen: np.ndarray) -> None:
        """The layer's token set is loaded and its compute dispatched: score the speculation made for it, record
        which chunks it needed, and request the next layers' certain reads."""
        if self.engine.speculator is not None:
            store = self.engine.store
            self.engine.speculator.usage.record(layer, np.unique(self._chunks_of_all(layer)),
                                                store.locate(self.match, chosen, layer).unique_chunks())
        guess = self.prefetched.pop(layer, None)
        if guess is not None:
            hit = len(np.intersect1d(guess, chosen, assume_unique=True))
            self.stats["prefetched"] += len(guess)
            self.stats["used"] += len(chosen)
            self.stats["hit"] += hit
        self._request_ahead(layer + 1, chosen)
        self.read_ahead(layer + 2)

    def take(self, layer: int, kind: int, positions, pad_to: int, phase: str = "kv_io_stall", importance=None):
        """Vectors [heads, pad_to, d] of `positions` (zeros after them), waiting only for what is missing;
        `importance` (per position) feeds the attention-score cache."""
        opened = self._window_opened.pop(layer, None) if kind != PROBE else None
        if opened is not None:
            self.engine.speculator.observe_window(opened)
        taken = self.clock.timed(phase, self.engine.prefetcher.take, self.match, layer, kind, positions,
                                 importance=importance, pad_to=pad_to)
        if not taken.ok.all():
            raise _BadChunk()
        return taken.array

    def take_all(self, layer: int, kind: int, phase: str = "kv_io_stall"):
        return self.take(layer, kind, self.all_positions, self.m_pad, phase)

    def prefetch_report(self) -> dict:
        s = self.stats
        if not s["prefetched"]:
            return {"prefetched_tokens": 0, "used_tokens": s["used"], "hit_tokens": 0,
                    "precision": None, "recall": None}
        return {"prefetched_tokens": s["prefetched"], "used_tokens": s["used"], "hit_tokens": s["hit"],
                "precision": s["hit"] / s["prefetched"], "recall": s["hit"] / max(s["used"], 1)}

    def close(self) -> None:
        if self.engine.prefetcher is not None:
            self.engine.prefetcher.close()
