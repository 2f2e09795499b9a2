"""The prefill engine: one request's layer loop over reused prefix KV (docs/architecture.md).

Device work is the pure jitted steps of `specjax.engine.steps` (built on `specjax.models.transformer` and
`specjax.kernels`); the host loop only moves indices and bytes through `specjax.engine.layer_io`: it asks the
prefetcher for what a layer needs, starts reads for the next layer before computing this one, and writes the new
prefix tokens' KV behind. A `System` decides what each layer loads; the loop is the same for all of them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import distributed
from specjax import sharding as sh
from specjax.connector import LOW_BIT_FORMAT, KVStore, Prefetcher, Reorderer, StoreError, TieredCache
from specjax.engine import state as st
from specjax.engine import steps as S
from specjax.engine.identify import policy
from specjax.engine.policy_steps import Facts, probe_kv_heads
from specjax.engine.policies import Layers, runs
from specjax.engine.precision import Precision, WithRest, check_store
from specjax.engine import processes
from specjax.engine.clock import Clock
from specjax.engine.layer_io import BadChunk, LayerIO, ReadPath
from specjax.engine.replay import Recorder, Replay
from specjax.engine.speculation import Speculator, prefetch_report
from specjax.engine.systems import System
from specjax.engine.types import EngineConfig, LayerKV, LayerRecord, Request, RequestResult
from specjax.errors import SpecjaxError
from specjax.idsets import distinct
from specjax.kernels import SharedIndices
from specjax.models import transformer as T
from specjax.models.inference import bucket, log_softmax

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Prefill:
    """What a schedule (`Engine.prefill` and its overrides) hands the request loop once the first token's logits
    are dispatched."""

    logits: jax.Array
    layers_kv: list[LayerKV]  # what each layer attended to; continuations attend to the same
    own_tokens: int  # the computed tokens among each layer's own_k rows, which continuations also attend to
    reused_tokens: int  # m: stored prefix tokens matched
    computed_tokens: int
    layers: LayerRecord
    prefetch: Callable[[], dict] = prefetch_report  # its report, asked for once `then` has run
    then: list[Callable[[], object]] = dataclasses.field(default_factory=list)  # after the first token, in order
    selections: list | None = None  # per layer, the chosen positions (kept with EngineConfig.trace)
    split: dict | None = None  # cake's meeting point
    bad_chunk: bool = False  # a chunk failed its checksum and was computed instead (cake)


# `Engine.repair_io` and `RequestResult.repair_io`: what damaged stored KV cost beyond the system's own I/O, each
# count with the store metric it is measured by. disk_bytes: the reads of attempts abandoned at a bad chunk and of
# the repairs' checks; disk_bytes_written: the repairs' writes; damaged_chunks: the chunks the repairs found failing.
REPAIR_COUNTS = {"disk_bytes": "disk_bytes", "disk_bytes_written": "disk_bytes_written",
                 "damaged_chunks": "bad_chunks"}


def fingerprint(model, chunk_tokens: int, kv_bits=()) -> dict:
    """What a store must agree on with the model that reads it: the weights and tokenizer (their digests,
    `specjax.api.Model`), the shapes, dtype and layout, and the low precisions it holds K and V at besides the
    model's dtype (`kv_bits`, a system's `store_bits`, with the kinds held so, `kv_format`). `weights_source` only
    says where the weights came from (stores do not compare it), so that a refusal or fsck can name them."""
    c = model.config
    bits = {"kv_bits": sorted(set(map(int, kv_bits)), reverse=True), "kv_format": LOW_BIT_FORMAT} if kv_bits else {}
    return {**bits, "arch": c.arch, "num_layers": c.num_layers, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "dtype": jnp.dtype(model.dtype).name,
            "chunk_tokens": chunk_tokens, "probe_heads": len(probe_kv_heads(c)),
            "weights": model.weights_digest, "tokenizer": getattr(model, "tokenizer_digest", None),
            "weights_source": _weights_source(model)}


def _weights_source(model) -> str:
    where = getattr(model, "path", None)
    return f"{model.name} ({getattr(model, 'weights', 'pretrained')}{f', {where}' if where else ''})"


def shape_key(prefix, query, continuations) -> tuple:
    """What decides the device programs a request runs once its prefix is stored: the prefix (its length and how
    the store chunks it), the bucket of its new tokens and the bucket of its longest continuation. Two requests
    with one key compile nothing the other has not (the evaluation's untimed compile pass relies on it)."""
    return tuple(prefix), bucket(len(query)), _continuation_bucket(max(map(len, continuations), default=1))


def _continuation_bucket(tokens: int) -> int:
    return bucket(tokens, minimum=8)


@runs(Layers)
class Engine:
    """Runs requests for one system over one store; owns that system's caches and prefetcher."""

    def __init__(self, model, system: System, store: KVStore | None, config: EngineConfig = EngineConfig(), *,
                 selections: Recorder | Replay | None = None):
        """`selections`: a selection trace its identification records its scores into or replays them from
        (`specjax.engine.replay`; None: neither)."""
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
        self.mesh = getattr(model, "mesh", None)  # tensor parallel (specjax.sharding); None: one device
        # the mesh spans several processes: each reads and holds its own KV heads (specjax.engine.processes)
        self.processes = distributed.spans_processes(self.mesh)
        # how a layer chooses its tokens, and what it knows deciding (`LayerIO.select` carries its steps out)
        self.identification = policy(system.identify)
        if system.rest_bits is not None:  # what it does not select, loaded at low precision (spec_mixed)
            self.identification = WithRest(self.identification, system.rest_bits, system.rest_key_bits)
        self.facts = Facts.of(self.cfg, system, store.layout.chunk_tokens if store is not None else None,
                              config.kernel_impl)
        if store is not None:
            check_store(system, store.layout)
        # which store kind a take of K or V reads, decoded on the device where it is low-bit
        self.precision = (Precision(store.layout, system.kv_bits, model.dtype, self.facts.probe_is_k)
                          if store is not None else None)
        self.probe_kv = np.asarray(self.facts.probe_kv)  # the KV heads whose keys the store's probe kind holds
        self.cache = self.prefetcher = self.speculator = self.io_worker = None
        self._cpu_cache_bytes = config.cpu_cache_bytes
        self.requests_run = 0
        self.selections = selections
        self.repaired: list[tuple[int, ...]] = []  # stored sequences whose chunks failed and were stored anew
        # what damaged stored KV cost beyond the system's own I/O, over the engine's life (`repair_io`)
        self.repair_io = dict.fromkeys(REPAIR_COUNTS, 0)
        # what the new tokens attend to when nothing comes before them: 16 zero rows, none selected
        self._no_prefix = self.place_kv(jnp.zeros((self.cfg.num_kv_heads, 16, self.cfg.head_dim), model.dtype))
        self._no_selection = SharedIndices(jnp.arange(16, dtype=jnp.int32), 0)
        if store is not None:
            # each device reads its own heads' bytes of every chunk file (one device, or replicated heads: whole)
            if self.processes:  # each process its own heads (specjax.engine.processes)
                store.split_reads(**processes.read_split(self.cfg, self.mesh, store.layout))
            else:
                store.split_reads({kind: sh.kv_parts(self.cfg, self.mesh, store.layout.heads(kind))
                                   for kind in store.layout.kinds()})
            # key summaries (spec_gqa's candidates) live in host memory: the host tier gives up their bytes
            if system.candidates is not None:
                self._cpu_cache_bytes = max(0, self._cpu_cache_bytes - store.summary_bytes)
            self.empty_caches()
            # queues each layer's reads ahead (LayerIO._read_ahead_of) while the request's thread goes on
            self.io_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specjax-read-ahead")

    def empty_caches(self) -> None:
        """Start the device and host tiers empty, and speculation with nothing learned."""
        if self.prefetcher is not None:
            self._let_go_of_caches()
        self.cache, self.prefetcher, self.speculator = self._new_caches()

    @contextlib.contextmanager
    def scratch_caches(self):
        """Within: device and host tiers and speculation of their own, empty at first; after: the engine's, untouched
        by what ran within (e.g. the planner's calibration, which must not warm the caches that timed requests find).
        Meanwhile the device holds both device tiers' pages."""
        saved = self.cache, self.prefetcher, self.speculator
        self.cache, self.prefetcher, self.speculator = self._new_caches()
        try:
            yield
        finally:
            self._let_go_of_caches()
            self.cache, self.prefetcher, self.speculator = saved

    def _new_caches(self) -> tuple[TieredCache, Prefetcher, Speculator | None]:
        store, system, config = self.store, self.system, self.config
        cache = TieredCache(config.gpu_cache_bytes, self._cpu_cache_bytes, system.cache_policy, metrics=store.metrics)
        prefetcher = Prefetcher(store, cache, pcie_bandwidth=config.pcie_bandwidth)
        speculator = (Speculator(store, cache, always=system.prefetch.always) if system.prefetch.speculative
                      else None)
        return cache, prefetcher, speculator

    def _let_go_of_caches(self) -> None:
        """The engine stops using its caches: the last request's reads are settled, and the store stops telling them
        of freed chunks (and stops keeping them)."""
        self.prefetcher.close()
        self.store.off_free(self.cache.invalidate)
        if self.speculator is not None:
            self.store.off_free(self.speculator.usage.forget)

    def read_path(self) -> ReadPath:
        """What a request's reads go through now (a `LayerIO`'s: it sees these parts, not the engine)."""
        return ReadPath(self.store, self.prefetcher, self.cache, self.speculator, self.io_worker, self.identification,
                        self.facts, self.system, self.selections, self.place_kv, self.precision, self.processes)

    def place_kv(self, array):
        """K/V `[heads, tokens, head_dim]` as the model's mesh holds them: each device its own KV heads (a few probe
        heads' keys, or KV heads that do not divide the mesh: replicated). Unchanged without a mesh. On a mesh over
        several processes `array` need hold only this process's heads (what it read): each device gets its slice."""
        if self.mesh is None:
            return array
        sharding = sh.kv_sharding(self.cfg, self.mesh, array.shape[0])
        if self.processes:
            sharding = processes.by_process(self.cfg, self.mesh, array.shape[0]) or sharding
            return distributed.from_own_rows(array, sharding)
        return jax.device_put(array, sharding)

    def begin_insert(self, prefix, match):
        """A writer of `prefix`'s new KV over `match` (it owns the match from here): the store's, or on a mesh over
        several processes one that gathers each layer for process 0 to write (`processes.SharedWriter`)."""
        if self.processes:
            return processes.SharedWriter(self.store, prefix, match)
        return self.store.begin_insert(prefix, base=match)

    # -- storing prefixes ------------------------------------------------------------------------

    def warm(self, prefix) -> bool:
        """Store a prefix's exact KV (plain forward) unless it is stored already; True if it wrote."""
        prefix = [int(t) for t in prefix]
        match = self.store.match(prefix)
        if match.length == len(prefix):
            match.close()
            return False
        writer = self.begin_insert(prefix, match)
        n = len(prefix)
        h, positions, rotary = T.tokens_at(self.cfg, self.model.params, prefix, width=bucket(n))
        start = match.length
        pace = sh.Pace(self.mesh)  # on a CPU mesh, at most a layer ahead of the devices (sharding.Pace)
        with writer:
            for layer, lp in enumerate(self.model.params["layers"]):
                h, k, v = T.self_attention_layer(self.cfg, lp, h, positions, positions < n, rotary)
                writer.write_layer(layer, k[:, start:n], v[:, start:n], k[self.probe_kv, start:n])
                pace.step(h)
            writer.commit()
        return True

    # -- one request -----------------------------------------------------------------------------

    def run(self, request: Request) -> RequestResult:
        if not request.prefix and not request.query:
            raise SpecjaxError("a request needs at least one token")
        if self.selections is not None:
            self.selections.begin(request.index)
        spent = dict(self.repair_io)
        start = served_from = self._io_counts()
        try:
            result = self.attempt(request, reuse=self.system.reuse)
        except BadChunk:
            served_from = self._abandon(start)
            result = self.attempt(request, reuse=False)
            result.recomputed_bad_chunks = True
        if start is not None:
            self._measure(result, start, served_from)
        if result.recomputed_bad_chunks and not self.store.read_only:
            self._try_repair(request)
        result.repair_io = {k: self.repair_io[k] - spent[k] for k in spent}
        self.requests_run += 1
        if self.system.reorder and self.config.reorder_every and self.requests_run % self.config.reorder_every == 0:
            self.reorder()
        return result

    def _io_counts(self) -> tuple[dict, list[int]] | None:
        """The store's counters and per-device disk bytes now; None without a store."""
        if self.store is None:
            return None
        return self.store.metrics.snapshot(), self.store.metrics.device_bytes()

    def _abandon(self, start: tuple[dict, list[int]]) -> tuple[dict, list[int]]:
        """A request's attempt met a bad chunk and is given up: what it read is the damage's cost (`repair_io`), not
        the system's; the counts the request's own I/O runs from (now) are returned."""
        now = self._io_counts()
        self.repair_io["disk_bytes"] += now[0]["disk_bytes"] - start[0]["disk_bytes"]
        return now

    def _measure(self, result: RequestResult, start, served_from) -> None:
        """`result.io` and its per-device bytes: the store's counters over the attempt that answered the request
        (from `served_from`), and its bad chunks over the whole request (from `start`)."""
        (before, before_devices), (after, after_devices) = served_from, self._io_counts()
        result.io = {k: after[k] - before[k] for k in before if not k.endswith(("_ratio", "amplification"))}
        result.io["bad_chunks"] = after["bad_chunks"] - start[0]["bad_chunks"]
        before_devices = before_devices + [0] * (len(after_devices) - len(before_devices))
        result.disk_bytes_by_device = [a - b for a, b in zip(after_devices, before_devices)]

    def stored_keys(self, request: Request) -> list[list[int]]:
        """The token sequences the store holds a request's reused KV under: its prefix."""
        return [[int(t) for t in request.prefix]] if len(request.prefix) else []

    def _try_repair(self, request: Request) -> None:
        try:
            self.repair(self.stored_keys(request))
        except StoreError as e:  # the answer stands (it was recomputed); the damage stays for fsck to report
            log.warning("could not store anew the damaged KV of a request's prefix: %s", e)

    def repair(self, keys) -> int:
        """Stored KV of `keys` failed its checksum (the request was recomputed, never served from it): drop the
        stored prefixes holding a failing chunk, with what is stored below them, and store all of those anew from
        the plain forward, so that later requests find them whole and nothing good is lost. Returns how many
        stored sequences were dropped. What it reads and writes, and the damaged chunks it finds, are counted in
        `repair_io`. On a mesh over several processes process 0 finds and drops them (`processes.drop_failing`)."""
        before = self.store.metrics.snapshot()
        dropped = 0
        for key in keys:
            if self.processes:
                lost = processes.drop_failing(self.store, key)
            else:
                with self.store.match(key) as match:
                    failing = self.store.failing_nodes(match)
                lost = self.store.drop_nodes(failing)
            for sequence in [key, *lost]:
                self.warm(sequence)
            dropped += len(lost)
            self.repaired.append(tuple(key))
        after = self.store.metrics.snapshot()
        for count, metric in REPAIR_COUNTS.items():
            self.repair_io[count] += after[metric] - before[metric]
        return dropped

    def reorder(self) -> int:
        """Repack every radix node whose importance has been observed (SPEC's KV reordering; on a mesh over several
        processes, `processes.reorder`)."""
        return processes.reorder(self.store) if self.processes else Reorderer(self.store).run_once()

    def attempt(self, request: Request, *, reuse: bool, head: int = 0) -> RequestResult:
        """The request loop every system runs: its schedule (`prefill`) computes the first token from the stored
        prefix, registering what it opened (matches, the writer, reads) on one stack that closes them whatever
        happens; the clock stops at the first token; then what needs no answer before it (`Prefill.then`: commits,
        feedback), the continuations against the same KV, and one result shape.

        `head`: the first stored tokens to compute instead of loading (the planner's plan; fewer than stored)."""
        clock = Clock()
        with contextlib.ExitStack() as opened:
            prefill = self.prefill(request, reuse, head, clock, opened)
            ttft, breakdown = clock.finish()
            exposed = clock.exposed_host_ms(self.store.scheduler.busy_intervals(clock.start_monotonic)
                                            if self.store is not None else [])
            for step in prefill.then:
                step()
        first = np.asarray(prefill.logits, np.float32)
        m = prefill.reused_tokens
        n = len(request.prefix) + len(request.query) - m
        contexts = ([S.context_for_continuation(kv, prefill.own_tokens) for kv in prefill.layers_kv]
                    if request.continuations else [])
        conts = [self._score(contexts, first, m, n, c) for c in request.continuations]
        return RequestResult(
            first_token_logits=first, continuation_logprobs=conts, ttft_ms=ttft, breakdown_ms=breakdown,
            reused_tokens=m, computed_tokens=prefill.computed_tokens, io={}, layers=prefill.layers,
            prefetch=prefill.prefetch(), recomputed_bad_chunks=prefill.bad_chunk,
            selections=prefill.selections if self.config.trace else None, split=prefill.split,
            host_exposed_ms=exposed, cpu_ms=clock.cpu_ms)

    def prefill(self, request: Request, reuse: bool, head: int, clock: Clock, opened: contextlib.ExitStack) -> Prefill:
        """The layer loop's schedule: each layer's stored KV is loaded (what its identification selects, read through
        `LayerIO`), after a computed `head` of the stored prefix; the new prefix tokens' KV is written behind. The
        system's identification then chooses among the other r = m - head stored tokens, and every head token is
        kept."""
        cfg, system = self.cfg, self.system
        tokens = [int(t) for t in request.prefix] + [int(t) for t in request.query]
        match = opened.enter_context(self.store.match(request.prefix)) if reuse else None
        m = match.length if match is not None else 0
        if m and not 0 <= head < m:
            raise SpecjaxError(f"a computed head of {head} tokens must be shorter than the {m} stored")
        head = head if m else 0
        r = m - head  # stored tokens loaded
        n, new_prefix = len(tokens) - m, len(request.prefix) - m
        m_pad = bucket(max(r, 1))
        k = min(r, max(1, math.ceil(self.config.retention * r))) if system.prunes else r
        k_cap = bucket(max(k, 1))
        state = st.ImportanceState.init(cfg.num_layers, m_pad)
        writer = None
        if reuse and new_prefix > 0:  # it owns `match` from here, and releases it when it commits or aborts
            writer = self.begin_insert(request.prefix, match)
            opened.callback(writer.abort)  # a no-op once committed
        io = LayerIO(self.read_path(), match, r, m_pad, clock, first=head)
        opened.callback(io.close)
        if m == 0 and 0 < self.config.prefill_chunk_tokens < n:
            logits, layers_kv = self._prefill_chunked(tokens, writer, new_prefix, clock)
            importance, traced = [], []
            own_tokens = 0  # the computed tokens' KV is the layers' buffers, as for a reused prefix
        else:
            logits, layers_kv, state, importance, traced = self._prefill_block(
                io, m, n, k, k_cap, state, tokens, writer, new_prefix, head)
            io.agree_on_bad_chunks()
            own_tokens = n
        # After the first token: what the selections tell later requests, importance feedback for reordering (of the
        # whole stored prefix, as an identification measured it: none when a head was computed or every token was
        # loaded), then the write-behind commit.
        then = [io.after_first_token]
        if importance and not head and system.prunes:
            then.append(lambda: self.store.record_importance(match, np.stack([layer() for layer in importance])))
        if writer is not None:
            then.append(writer.commit)
        return Prefill(logits, layers_kv, own_tokens, reused_tokens=m, computed_tokens=n + head,
                       layers=_layer_record(state, r, head), prefetch=io.prefetch_report, then=then,
                       selections=traced)

    def _prefill_block(self, io, m, n, k, k_cap, state, tokens, writer, new_prefix, head=0):
        """The n new tokens as one block over the (selected) reused prefix, layer by layer:
        (first-token logits, per-layer KV, state, importance per layer, traced selections).

        With a `head`, the first head stored tokens are computed alongside, layer by layer (their own causal
        block), and joined in front of what the layer selected of the loaded rest."""
        cfg, params = self.cfg, self.model.params
        n_pad = bucket(n)
        if m:
            io.plan_reads(range(cfg.num_layers))
        if head:  # the computed head of the stored prefix: its own causal block from position 0
            h_head, head_positions, head_rotary = T.tokens_at(cfg, params, tokens[:head], 0, bucket(head))
        h, positions, rotary = T.tokens_at(cfg, params, tokens[m:], m, n_pad)
        pace = sh.Pace(self.mesh, io.clock.device_wait)  # on a CPU mesh, a layer ahead at most (sharding.Pace)
        layers_kv, importance, traced = [], [], []
        for layer, lp in enumerate(params["layers"]):
            if m == 0:  # nothing reused: the plain forward's layer (as models.inference.forward_hidden)
                prefix_k = prefix_v = self._no_prefix
                selection = self._no_selection
                dispatched = time.monotonic()
                h, own_k, own_v = T.self_attention_layer(cfg, lp, h, positions, positions < n, rotary)
            else:
                q, own_k, own_v = S.project(cfg, lp, h, positions, rotary)
                if head:
                    h_head, head_k, head_v = T.self_attention_layer(cfg, lp, h_head, head_positions,
                                                                    head_positions < head, head_rotary)
                got = io.select(self.identification, state, layer, q, own_k, n, k, k_cap)
                state, prefix_k, prefix_v, selection = got.state, got.keys, got.values, got.selection
                imp, chosen, logits = got.importance, got.chosen, got.logits
                if head:  # rows in front of the selection that no scoring saw
                    prefix_k, prefix_v, selection = S.with_head(head_k, head_v, head, prefix_k, prefix_v, selection)
                    logits = None
                importance.append(imp)
                traced.append(chosen)
                dispatched = time.monotonic()
                h = S.finish(cfg, lp, h, q, own_k, own_v, prefix_k, prefix_v, selection, n,
                             impl=self.config.kernel_impl, logits=logits)
            io.clock.device_work(dispatched, h)  # the layer's compute, which the host goes on past
            if m:
                # Dispatched: the next layer's reads are issued while the device computes this one.
                io.after_selection(layer, distinct(chosen))
            layers_kv.append(LayerKV(prefix_k, prefix_v, selection, own_k, own_v))
            if writer is not None:
                writer.write_layer(layer, own_k[:, :new_prefix], own_v[:, :new_prefix],
                                   own_k[self.probe_kv, :new_prefix])
            pace.step(h)
        logits = io.clock.device_wait(S.head_row(cfg, params, h, n - 1))
        return logits, layers_kv, state, importance, traced

    # -- chunked prefill (nothing reused) ----------------------------------------------------------------

    def _prefill_layer(self, lp, h, positions, rotary, keys, values, lo: int, count: int):
        """One layer of a chunk of new tokens at token `lo` (`count` valid rows) over this layer's buffers keys /
        values (`S.layer_over_buffers`). Returns (next hidden, keys, values)."""
        return S.layer_over_buffers(self.cfg, lp, h, positions, rotary, keys, values, lo, count)

    def _prefill_chunked(self, tokens, writer, new_prefix, clock: Clock):
        """Chunked prefill of all tokens (none reused): chunk by chunk through every layer, each chunk's K/V
        written into per-layer buffers that later chunks attend to. The writer gets a layer's new prefix KV
        as soon as the last chunk has passed that layer. (first-token logits, per-layer KV)."""
        cfg, params, c = self.cfg, self.model.params, self.config.prefill_chunk_tokens
        n = len(tokens)
        n_chunks = -(-n // c)
        width = n_chunks * c  # whole chunks, so no write is clipped
        shape = (cfg.num_kv_heads, width, cfg.head_dim)
        keys = S.zero_buffers(cfg.num_layers, shape, self._no_prefix.dtype)
        values = S.zero_buffers(cfg.num_layers, shape, self._no_prefix.dtype)
        pace = sh.Pace(self.mesh, clock.device_wait)  # every chunk's layers in one queue (sharding.Pace)
        for j in range(n_chunks):
            lo = j * c
            count = min(c, n - lo)
            size = min(c, bucket(count))  # a partial last chunk is padded only to its bucket
            h, positions, rotary = T.tokens_at(cfg, params, tokens[lo:lo + count], lo, size)
            for layer, lp in enumerate(params["layers"]):
                h, keys[layer], values[layer] = self._prefill_layer(lp, h, positions, rotary, keys[layer],
                                                                    values[layer], lo, count)
                if writer is not None and j == n_chunks - 1:
                    writer.write_layer(layer, keys[layer][:, :new_prefix], values[layer][:, :new_prefix],
                                       keys[layer][self.probe_kv, :new_prefix])
                pace.step(h)
        logits = S.head_row(cfg, params, h, count - 1).block_until_ready()
        selection = SharedIndices(jnp.asarray(np.arange(width, dtype=np.int32)), n)
        return logits, [LayerKV(keys[i], values[i], selection, keys[i][:, :0], values[i][:, :0])
                        for i in range(cfg.num_layers)]

    # -- continuation scoring against the same (pruned) KV ----------------------------------------

    def _score(self, contexts: list[tuple], first_logits, m, n, continuation) -> tuple[float, bool]:
        """(sum logprob, greedy) of a continuation attending to each layer's context (prefix selection + computed)."""
        cfg, params = self.cfg, self.model.params
        cont = [int(t) for t in continuation]
        if not cont:
            raise SpecjaxError("cannot score an empty continuation")
        c = len(cont)
        h, positions, rotary = T.tokens_at(cfg, params, cont, m + n, _continuation_bucket(c))
        pace = sh.Pace(self.mesh)  # on a CPU mesh, at most a layer ahead of the devices (sharding.Pace)
        for lp, (prefix_k, prefix_v, selection) in zip(params["layers"], contexts):
            q, own_k, own_v = S.project(cfg, lp, h, positions, rotary)
            h = S.finish(cfg, lp, h, q, own_k, own_v, prefix_k, prefix_v, selection, c,
                        impl=self.config.kernel_impl)
            pace.step(h)
        logits = np.concatenate([first_logits[None], np.asarray(T.head_step(cfg, params, h))[: c - 1]], 0)
        logprobs = log_softmax(logits)  # on the host: no device program per continuation length
        target = np.asarray(cont)
        return float(logprobs[np.arange(c), target].sum()), bool((logits.argmax(-1) == target).all())


def _layer_record(state: st.ImportanceState, r: int, head: int) -> LayerRecord:
    """The record of a request whose layers identified among the r loaded stored tokens (after a computed `head`)."""
    host = distributed.to_host
    retained, count = host(state.retained), host(state.count)
    loaded = count / max(r, 1)
    recomputed = [head / (head + r) if head + r else 1.0] * len(retained)
    return LayerRecord(r, np.where(np.isnan(retained), loaded, retained).tolist(), count.tolist(), recomputed,
                       host(state.fallback).tolist(), host(state.jaccard).tolist(), host(state.threshold).tolist(),
                       host(state.head_share).tolist())
