"""Cake (docs/systems.md): the device prefills the stored prefix chunk by chunk from the front while a loader thread
reads its stored KV chunk by chunk from the back; they stop where they meet, then the new tokens are prefilled
over the assembled prefix KV. Exact (nothing is pruned) and without a knob: the meeting point is wherever the
measured compute and I/O speeds put it.

Device work is the engine's jitted steps: chunk j is prefilled exactly as the engine prefills new tokens over a
stored prefix, the "stored prefix" being the chunks before j that the device computed itself.

On a mesh over several processes each process's loader reads its own KV heads, and the device side goes by where
every process's loader has reached (`_Meeting`'s `agree`: one small collective before each layer it computes), so
that every process computes and absorbs the same chunks.
"""

from __future__ import annotations

import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import distributed
from specjax import sharding as sh
from specjax.connector import K_RANGE, K, V, in_chunk_range
from specjax.engine import steps as S
from specjax.engine.engine import Engine, Prefill
from specjax.engine.policies import Cake, runs
from specjax.engine.precision import range_rows, take_decoded
from specjax.engine.clock import Clock
from specjax.engine.types import EngineConfig, LayerKV, LayerRecord, Request
from specjax.errors import SpecjaxError
from specjax.kernels import SharedIndices
from specjax.models import transformer as T
from specjax.models.inference import bucket

# Layers of a chunk the loader keeps in flight: enough to keep the (emulated) disk busy between reads, few enough
# that little is left queued on it when the device finishes the chunk first.
LOADER_WINDOW_LAYERS = 4
_POLL_S = 0.005  # how often a waiting loader looks whether the device made its chunk unnecessary


# ---- jitted device steps -----------------------------------------------------------------------


@functools.partial(jax.jit, donate_argnums=0)
def _put_chunk(bufs, rows, start):
    """Every layer's buffer [H, M, d] with that layer's rows [H, C, d] written at token `start`, in place."""
    return [S.put(b, r, start) for b, r in zip(bufs, rows)]


# ---- who does which chunk ----------------------------------------------------------------------


class _Meeting:
    """Which cake chunks are done, and by whom. The device takes chunks from the front, the loader from the back.
    The last chunk left may be worked on by both at once; whichever finishes it first owns it.

    The device side goes by where the loaded chunks begin as `agree` makes it of this process's loader's progress:
    unchanged in one process; on a mesh over several processes the latest start any process's loader has reached (a
    chunk counts as loaded once every process holds its heads of it), so that every process computes, absorbs and
    stops alike."""

    def __init__(self, n_chunks: int, agree=lambda back: back):
        self._lock = threading.Lock()
        self._agree = agree
        self.front = 0  # chunks [0, front) are computed on the device
        self.back = n_chunks  # chunks [back, n_chunks) are loaded; their KV is in `loaded`
        self.loaded: dict[int, tuple[list, list]] = {}  # chunk -> per-layer K and V [kv_heads, chunk, d]
        self.stopped = False  # the device met the loader: stop loading
        self.bad_chunk = False  # the loader met a chunk failing its checksum and stopped before it
        self.error: BaseException | None = None

    # the device's side
    def loaded_start(self) -> int:
        """The first of the loaded chunks at the back, agreed (`agree`)."""
        with self._lock:
            back = self.back
        return self._agree(back)

    def next_to_compute(self, back: int) -> int | None:
        with self._lock:
            return self.front if self.front < back else None

    def computed(self, chunk: int) -> None:
        with self._lock:
            self.front = max(self.front, chunk + 1)

    def published(self, since: set, back: int) -> list[int]:
        """The loaded chunks from `back` (a `loaded_start`) on, but those in `since`: this process's loader has
        published every one of them (it goes from the back, and `back` is at or after its own start)."""
        with self._lock:
            return sorted(j for j in self.loaded if j >= back and j not in since)

    def halt(self) -> None:
        """No more loading (this process's: nothing agreed)."""
        with self._lock:
            self.stopped = True

    def stop(self) -> int:
        """No more loading; returns the split, agreed: chunks before it are the device's, the rest the loader's."""
        self.halt()
        return self.loaded_start()

    # the loader's side
    def next_to_load(self) -> int | None:
        with self._lock:
            j = self.back - 1
            ok = not (self.stopped or self.bad_chunk or self.error) and j >= self.front
            return j if ok else None

    def unneeded(self, chunk: int) -> bool:
        with self._lock:
            return self.stopped or self.front > chunk

    def publish(self, chunk: int, keys: list, values: list) -> bool:
        with self._lock:
            if self.stopped or self.front > chunk:
                return False  # the device finished it first
            self.loaded[chunk] = (keys, values)
            self.back = chunk
            return True

    def fail(self, bad_chunk: bool = False, error: BaseException | None = None) -> None:
        with self._lock:
            self.bad_chunk |= bad_chunk
            self.error = self.error or error


class _Loader(threading.Thread):
    """Reads every layer's stored K and V of cake chunks, the last chunk first, through the engine's prefetcher
    and caches (so bytes, chunks and hits are counted as for every system), until it meets the device."""

    def __init__(self, engine: "CakeEngine", match, meeting: _Meeting, m: int):
        super().__init__(name="cake-loader", daemon=True)
        self.engine, self.match, self.meeting, self.m = engine, match, meeting, m
        self.gave_up_chunk = False

    def run(self) -> None:
        try:
            while (j := self.meeting.next_to_load()) is not None:
                if not self._load(j):
                    break
        except BaseException as e:  # noqa: BLE001 -- handed to the request, which raises it
            self.meeting.fail(error=e)

    def _load(self, j: int) -> bool:
        engine, meeting, pf, c = self.engine, self.meeting, self.engine.prefetcher, self.engine.chunk_tokens
        positions = np.arange(j * c, min((j + 1) * c, self.m))
        num_layers = engine.cfg.num_layers
        tickets: dict[int, tuple] = {}
        precision = engine.precision  # K and V at the system's precision, decoded on the device
        k_kind, v_kind = precision.kind(K), precision.kind(V)

        ranges = (K_RANGE,) if in_chunk_range(k_kind) else ()  # low-bit K decodes with its chunk's range

        def ask(layer: int) -> None:
            if layer < num_layers:
                tickets[layer] = tuple(pf.request(self.match, layer, kind, positions)
                                       for kind in (k_kind, v_kind) + ranges)

        for layer in range(LOADER_WINDOW_LAYERS):
            ask(layer)
        keys, values = [], []
        for layer in range(num_layers):
            for ticket in tickets.pop(layer):
                while not pf.wait([ticket], _POLL_S):
                    if meeting.unneeded(j):
                        return self._give_up()
            if meeting.unneeded(j):
                return self._give_up()
            ask(layer + LOADER_WINDOW_LAYERS)
            loc = engine.store.locate(self.match, positions, layer)
            takes = [take_decoded(pf, self.match, layer, kind, positions, loc, c, precision.decode)
                     for kind in (k_kind, v_kind)]
            if not all(t.ok.all() for taken in takes for t in (taken[0], taken[2]) if t is not None):
                meeting.fail(bad_chunk=True)  # never served: the device computes this chunk and those before it
                pf.close()
                return False
            keys.append(engine.place_kv(takes[0][1]))  # each device its heads
            values.append(engine.place_kv(takes[1][1]))
        return meeting.publish(j, keys, values) or self._give_up()

    def _give_up(self) -> bool:
        self.gave_up_chunk = True
        self.engine.prefetcher.close()  # forget this chunk's remaining reads
        return False


# ---- the engine ---------------------------------------------------------------------------------


@runs(Cake)
class CakeEngine(Engine):
    """The engine with Cake's schedule for the stored prefix; storing prefixes, caches and scoring are the engine's."""

    def __init__(self, model, system, store, config: EngineConfig = EngineConfig(), **kwargs):
        super().__init__(model, system, store, config, **kwargs)
        system.schedule.check(config, store.layout.chunk_tokens)
        self.chunk_tokens = config.cake_chunk_tokens
        self._compiled: set[tuple[int, int]] = set()  # (prefix buffer width, tokens in the last store chunk)
        self._no_prefix = jnp.zeros((self.cfg.num_kv_heads, 16, self.cfg.head_dim), model.dtype)

    def prefill(self, request: Request, reuse: bool, head: int, clock: Clock, opened) -> Prefill:
        """Cake's schedule: the stored prefix computed from the front and loaded from the back until they meet, then
        the new tokens over all of it, their KV written behind."""
        if head:
            raise SpecjaxError("cake chooses its own split of the stored prefix: it computes no planned head")
        if not reuse:
            return super().prefill(request, reuse, head, clock, opened)
        cfg, c = self.cfg, self.chunk_tokens
        prefix = [int(t) for t in request.prefix]
        tokens = prefix + [int(t) for t in request.query]
        match = self.store.match(prefix)
        m = match.length
        if m == 0:  # a cold request: nothing stored to load, so the engine's (chunked) prefill, written behind
            match.close()
            prefill = super().prefill(request, reuse, head, clock, opened)
            prefill.split = {"stored_tokens": 0, "computed_prefix_tokens": 0, "loaded_prefix_tokens": 0,
                             "chunk_tokens": self.chunk_tokens, "chunks": 0, "computed_chunks": 0,
                             "loaded_chunks": 0, "device_gave_up_chunk": False, "loader_gave_up_chunk": False,
                             "bad_chunk": False}
            return prefill
        opened.enter_context(match)
        n_chunks = -(-m // c)
        width = max(n_chunks * c, 16)  # prefix buffer: whole chunks, so no write is clipped
        shapes = (width, m % self.store.layout.chunk_tokens)
        if shapes not in self._compiled:
            self._compile(width, n_chunks, m)
            self._compiled.add(shapes)
            clock.restart()  # compiling is no request's time to first token
        n, new_prefix = len(tokens) - m, len(prefix) - m
        writer = None
        if new_prefix > 0:  # it owns `match` from here, and releases it when it commits or aborts
            writer = self.begin_insert(prefix, match)
            opened.callback(writer.abort)  # a no-op once committed
        opened.callback(self.prefetcher.close)
        meeting = _Meeting(n_chunks, distributed.max_over_processes if self.processes else (lambda back: back))
        loader = _Loader(self, match, meeting, m)
        opened.callback(self._stop_loader, meeting, loader)
        shape = (cfg.num_kv_heads, width, cfg.head_dim)
        keys = S.zero_buffers(cfg.num_layers, shape, self._no_prefix.dtype)
        values = S.zero_buffers(cfg.num_layers, shape, self._no_prefix.dtype)
        keys, values, split, device_gave_up = self._meet(meeting, loader, keys, values, prefix, m, clock)
        logits, layers_kv = self._over_prefix(tokens[m:], m, keys, values, width, writer, new_prefix, clock)
        computed = min(split * c, m)
        prefill = Prefill(
            logits, layers_kv, n, reused_tokens=m, computed_tokens=n + computed,
            layers=LayerRecord.split(cfg.num_layers, m, computed),
            split={"stored_tokens": m, "computed_prefix_tokens": computed, "loaded_prefix_tokens": m - computed,
                   "chunk_tokens": c, "chunks": n_chunks, "computed_chunks": split,
                   "loaded_chunks": n_chunks - split, "device_gave_up_chunk": device_gave_up})

        def loader_stopped() -> None:  # after the first token: what the loader did once it has stopped
            self._stop_loader(meeting, loader)
            agreed = distributed.any_process if self.processes else bool  # the same outcome in every process
            if agreed(meeting.error is not None):  # the loader failed: the request fails, in every process
                raise meeting.error or SpecjaxError("cake's loader failed in another process (its error is there)")
            prefill.bad_chunk = agreed(meeting.bad_chunk)
            prefill.split.update(loader_gave_up_chunk=agreed(loader.gave_up_chunk), bad_chunk=prefill.bad_chunk)

        prefill.then = [loader_stopped] + ([writer.commit] if writer is not None else [])
        return prefill

    def _meet(self, meeting: _Meeting, loader: _Loader, keys, values, prefix, m: int, clock: Clock):
        """The device computes chunks from the front while `loader` loads them from the back, until they meet: the
        prefix buffers then holding every chunk, the chunks computed, and whether the device gave a chunk up (the
        loader finished it first)."""
        absorbed: set[int] = set()
        device_gave_up = False
        loader.start()
        while True:
            back = meeting.loaded_start()
            keys, values = self._absorb(meeting, back, absorbed, keys, values)
            if (j := meeting.next_to_compute(back)) is None:
                break
            if self._compute_chunk(j, prefix, m, keys, values, meeting, clock, back):
                meeting.computed(j)
            else:
                device_gave_up = True  # the loader finished this chunk first
        split = meeting.stop()
        keys, values = clock.timed("kv_io_stall", self._absorb, meeting, split, absorbed, keys, values, wait=True)
        return keys, values, split, device_gave_up

    def _over_prefix(self, new_tokens, m: int, keys, values, width: int, writer, new_prefix: int, clock: Clock):
        """(first-token logits, every layer's `LayerKV`): the new tokens (unstored prefix tail + query) over the whole
        stored prefix `keys`/`values` of m tokens, as the engine does for as_full; the tail's KV written behind."""
        cfg, params, n = self.cfg, self.model.params, len(new_tokens)
        h, positions, rotary = T.tokens_at(cfg, params, new_tokens, m, bucket(n))
        selection = SharedIndices(jnp.asarray(np.arange(width, dtype=np.int32)), m)
        layers_kv = []
        pace = sh.Pace(self.mesh, clock.device_wait)  # on a CPU mesh, a layer ahead at most (sharding.Pace)
        for layer, lp in enumerate(params["layers"]):
            q, own_k, own_v = S.project(cfg, lp, h, positions, rotary)
            dispatched = time.monotonic()
            h = S.finish(cfg, lp, h, q, own_k, own_v, keys[layer], values[layer], selection, n,
                         impl=self.config.kernel_impl)
            clock.device_work(dispatched, h)  # the layer's compute, which the host goes on past
            layers_kv.append(LayerKV(keys[layer], values[layer], selection, own_k, own_v))
            if writer is not None:
                writer.write_layer(layer, own_k[:, :new_prefix], own_v[:, :new_prefix],
                                   own_k[self.probe_kv, :new_prefix])
            pace.step(h)
        return clock.device_wait(S.head_row(cfg, params, h, n - 1)), layers_kv

    @staticmethod
    def _stop_loader(meeting: _Meeting, loader: _Loader) -> None:
        """No more loading, and the loader stopped (a step of this process alone: no collective)."""
        meeting.halt()
        if loader.ident is not None:  # started
            loader.join()

    # -- the device's side ---------------------------------------------------------------------------

    def _chunk_layer(self, j: int, lp, h, positions, rotary, keys, values, count):
        """One layer of chunk j: writes its K/V into keys / values and attends causally to the device's chunks
        before it and to itself (the engine's chunked-prefill step). Returns (next hidden, keys, values)."""
        return self._prefill_layer(lp, h, positions, rotary, keys, values, j * self.chunk_tokens, count)

    def _compute_chunk(self, j: int, prefix, m: int, keys: list, values: list, meeting: _Meeting, clock: Clock,
                       back: int) -> bool:
        """Prefill chunk j through every layer, writing its K and V into the buffers; False if the loader
        finished the chunk first (checked between layers; before the first, by `back`, just agreed)."""
        cfg, params, c = self.cfg, self.model.params, self.chunk_tokens
        lo = j * c
        count = min(c, m - lo)
        h, positions, rotary = T.tokens_at(cfg, params, prefix[lo:lo + count], lo, c)
        for layer, lp in enumerate(params["layers"]):
            if (back if layer == 0 else meeting.loaded_start()) <= j:
                return False
            h, keys[layer], values[layer] = self._chunk_layer(j, lp, h, positions, rotary, keys[layer],
                                                              values[layer], count)
            clock.device_wait(h)  # layer by layer, so the check above follows the loader's progress
        return True

    def _absorb(self, meeting: _Meeting, back: int, absorbed: set, keys: list, values: list, wait: bool = False):
        """Write the loader's newly published chunks from `back` on into the prefix buffers."""
        for j in meeting.published(absorbed, back):
            chunk_keys, chunk_values = meeting.loaded[j]
            start = j * self.chunk_tokens
            keys = _put_chunk(keys, chunk_keys, start)
            values = _put_chunk(values, chunk_values, start)
            absorbed.add(j)
        if wait:
            jax.block_until_ready((keys, values))
        return keys, values

    def _compile(self, width: int, n_chunks: int, m: int) -> None:
        """Compile the device steps of both sides for a prefix of m tokens, outside any request's time: the chunk
        step for every chunk index (the meeting point moves with the measured speeds, so a timed request may
        reach an index no warm-up request reached), and the loader's assembly of whole and partial store chunks
        (compiled on the loader thread mid-request, it would hold up the device side)."""
        cfg, c, dtype = self.cfg, self.chunk_tokens, self._no_prefix.dtype
        lay = self.store.layout
        for kind in (self.precision.kind(K), self.precision.kind(V)):  # and its decoding, if it reads low-bit rows
            self.prefetcher.compile_assembly(kind, c)
            rows = jnp.zeros((lay.kv_heads, c, lay.width(kind)), lay.dtype_of(kind))
            ranges = None
            if in_chunk_range(kind):  # and of the ranges of the store chunks it spans, as `take_decoded` takes them
                size = range_rows(-(-c // lay.chunk_tokens), lay.chunk_tokens)
                self.prefetcher.compile_assembly(K_RANGE, size)
                ranges = (jnp.zeros((lay.kv_heads, size, lay.width(K_RANGE)), jnp.uint8), np.zeros(c, np.int32))
            jax.block_until_ready(self.precision.decode(kind, rows, ranges))
        chunk = T.tokens_at(cfg, self.model.params, [], 0, c)  # a chunk of padding: only its shapes matter
        positions, rotary = chunk.positions, chunk.rotary
        shape = (cfg.num_kv_heads, width, cfg.head_dim)
        buffers = S.zero_buffers(cfg.num_layers, shape, dtype)
        pace = sh.Pace(self.mesh)  # on a CPU mesh, at most a layer ahead of the devices (sharding.Pace)
        for j in range(n_chunks):
            h = chunk.hidden
            for lp in self.model.params["layers"][:2]:  # the first layer's input is an embedding, later ones not
                h, buffers[0], buffers[1] = self._chunk_layer(j, lp, h, positions, rotary, buffers[0], buffers[1],
                                                              c)
                pace.step(h)
        rows = [jnp.zeros((cfg.num_kv_heads, c, cfg.head_dim), dtype)] * cfg.num_layers
        jax.block_until_ready(_put_chunk(buffers, rows, 0))


__all__ = ["CakeEngine"]
