"""The I/O side of one request: what is read for each layer and when (`LayerIO`), which carries out the steps a
layer's identification asks for (`specjax.engine.identify`) and times them on the request's clock
(`specjax.engine.clock.Clock`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import distributed
from specjax.connector import K_RANGE, K, KVStore, Locations, Prefetcher, TieredCache, V, in_chunk_range
from specjax.engine import events
from specjax.engine import policy_steps as P
from specjax.engine.clock import Clock
from specjax.engine.precision import range_rows, take_decoded
from specjax.engine.speculation import Speculator, prefetch_report
from specjax.engine.systems import System
from specjax.shapes import padded


@dataclasses.dataclass(frozen=True)
class ReadPath:
    """Everything a request's reads go through, as its engine holds them when the request starts (`Engine.read_path`):
    the store and the prefetcher over it with its caches, the speculator and the I/O worker (None where the system
    has none), the identification and what it knows (`identify.Facts`), the system the request runs (the planner's
    load-all plan runs another than `facts.system`), the selection trace being recorded or replayed, and `place_kv`,
    which puts a take's array where the layer attends to it (the engine's mesh), and `precision`, which store kind a
    take of K or V reads and how its rows are decoded (`specjax.engine.precision.Precision`). `processes`: the
    engine's mesh spans several processes (`specjax.engine.processes`): each holds only its own KV heads, and a bad
    chunk is agreed on at the end of the layer loop (`LayerIO.agree_on_bad_chunks`)."""

    store: KVStore
    prefetcher: Prefetcher | None
    cache: TieredCache | None
    speculator: Speculator | None
    io_worker: concurrent.futures.ThreadPoolExecutor | None
    identification: Any  # a policy of `identify.POLICIES`
    facts: P.Facts
    system: System
    selections: Any  # a `replay.Recorder` or `replay.Replay`, or None
    place_kv: Callable[[Any], Any]
    precision: Any  # a `specjax.engine.precision.Precision`
    processes: bool = False

    @property
    def num_layers(self) -> int:
        return self.facts.cfg.num_layers


@jax.jit
def _chunk_of_rows(chunk_of, rows):
    """Each of `rows`' (positions, chosen on the device) chunk, from every position's (`chunk_of`)."""
    return jnp.take(chunk_of, rows, mode="clip")


class BadChunk(Exception):
    """A chunk failed its checksum: this request's reuse is abandoned and it is recomputed."""


class LayerIO:
    """One request's reads through the prefetcher: what is requested ahead, what is taken, and timing."""

    def __init__(self, path: ReadPath, match, m: int, m_pad: int, clock: Clock, positions=None, first: int = 0):
        """`positions`: the m match positions the request reads, in order (default: 0..m-1). `first`: the positions
        this request's layers see are match positions first, first + 1, ... (the planner computes the ones before)."""
        self.path, self.match, self.m, self.m_pad, self.clock = path, match, m, m_pad, clock
        self.first = first
        self.all_positions = np.arange(m) if positions is None else np.asarray(positions, np.int64)
        self.prefetched: dict[int, np.ndarray] = {}
        # tokens, and layers guessed or not for want of paying (prefetch_report)
        self.stats = {"issued": 0, "ahead": 0, "needed": 0, "used": 0, "guess_hits": 0, "guessed_layers": 0,
                      "unpaid_layers": 0}
        self._behind: dict[int, list] = {}  # layer -> guessed positions not on their way when the layer took them
        self._selected: list = []  # (layer, chosen, guess, behind) per layer, until `after_first_token`
        self._window_opened: dict[int, float] = {}  # layer -> when its speculation was issued
        self._locations: dict = {}  # (layer, positions' bytes) -> Locations (`locate`)
        self._every_position: dict = {}  # layer -> Locations of every match position from `first` on
        self._ahead = None  # the reads the last `after_selection` queues on the engine's I/O worker (a future)
        self._plan = None  # the read plan being issued on the engine's I/O worker (a future; `plan_reads`)
        self._planned = -1  # the last layer whose planned reads are issued
        self._planned_cv = threading.Condition()
        # what a guess reads ahead, and what tells whether one pays (`Speculator.pays`): only with a speculator
        self._selection_kinds = (tuple(map(path.precision.kind, path.identification.selection_reads(path.facts)))
                                 if path.speculator is not None else ())
        if any(map(in_chunk_range, self._selection_kinds)):  # low-bit K's rows decode with their chunks' ranges
            self._selection_kinds += (K_RANGE,)
        self._selection_disk_bytes: dict[int, int] = {}  # layer -> bytes its selection kinds' takes read from disk
        self._chosen_takes: list = []  # (Residents, rows, count) taken on the device, not yet accounted for
        self._bad_chunk = False  # a take found one, on a mesh over several processes (`agree_on_bad_chunks`)

    def locate(self, layer: int, positions) -> Locations:
        """Where `positions` lie at `layer`: the store locates every position of the match once per layer and
        request, and a set of positions is indexed out of that (a layer's set is taken as K and V, recorded and
        ranked for the next layer's guess from one lookup)."""
        positions = np.asarray(positions, np.int64)
        key = (layer, positions.tobytes())
        loc = self._locations.get(key)
        if loc is None:
            every = self._every_position.get(layer)
            if every is None:
                every = self._every_position[layer] = self.path.store.locate(
                    self.match, np.arange(self.first, self.match.length), layer)
            if len(positions) and (positions.min() < 0 or positions.max() >= len(every.chunks)):
                raise IndexError(f"positions must lie in [0, {len(every.chunks)}) of the matched prefix past its "
                                 f"first {self.first} tokens")
            loc = self._locations[key] = Locations(every.chunks[positions], every.offsets[positions])
        return loc

    def _request(self, layer: int, kind: int, positions, *, speculative: bool = False, held: bool = False):
        """Start reading `positions`' chunks of (layer, kind) through the prefetcher, located through `locate` (kind
        as a policy names it: K and V are read at the request's precision, `ReadPath.precision`; low-bit K's chunks'
        ranges with it). `held`: the reads stay held until the layer's identification is done (`let_go_certain`),
        whatever its takes of the kind."""
        chunks = self.locate(layer, positions).unique_chunks()
        kind = self.path.precision.kind(kind)
        if in_chunk_range(kind):
            self.path.prefetcher.request(self.match, layer, K_RANGE, chunks=chunks, speculative=speculative,
                                         held=held)
        return self.path.prefetcher.request(self.match, layer, kind, chunks=chunks, speculative=speculative,
                                            held=held)

    def _request_certain(self, layer: int) -> None:
        """Request on demand what `layer` reads whatever it selects (the identification's certain reads), for systems
        that prefetch them, held until its identification is done: a policy may take a kind more than once (a set's
        rows, then every position's), and each chunk is read once."""
        if not self.path.system.prefetch.ahead:
            return
        for kind in self.path.identification.certain_reads(self.path.facts):
            self._request(layer, kind, self.all_positions, held=True)

    def let_go_certain(self, layer: int) -> None:
        """The layer's identification is done, or its takes made: let go of its certain reads (once issued)."""
        if self.path.prefetcher is not None:
            self._wait_planned(layer)
            self.path.prefetcher.let_go(layer)

    def plan_reads(self, layers) -> None:
        """The request's read plan: what each of `layers` reads whatever it selects (as_full: all K and V; H2O: all
        keys; SPEC: probe keys), at demand priority in layer order, so the disk works through them at its queue depth
        while the layers compute; selective reads are issued as each layer's set is known. The plan is issued by the
        engine's I/O worker, layer by layer, while this thread goes on to compute the first layer (issuing every
        layer's reads is host work the first layer need not wait for); a layer's take waits until its planned reads
        are issued.
        ContiguousKV reads its first period's keys here and plans every later read itself (`plan_period`); a system
        that does not read ahead (`Prefetch.ahead`) reads each layer when it takes it."""
        layers = list(layers)
        if self.path.system.prefetch.periods and layers:
            self._request(layers[0], K, self.all_positions)
            return
        if self.path.io_worker is None or not self.path.system.prefetch.ahead or not layers:
            for layer in layers:
                self._request_certain(layer)
            return
        self._plan = self.path.io_worker.submit(self._issue_plan, layers)

    def _issue_plan(self, layers) -> None:
        try:
            for layer in layers:
                self._request_certain(layer)
                with self._planned_cv:
                    self._planned = layer
                    self._planned_cv.notify_all()
        finally:
            with self._planned_cv:
                self._planned = max(self._planned, self.path.num_layers)  # issued or failed: nobody waits
                self._planned_cv.notify_all()

    def _wait_planned(self, layer: int) -> None:
        """Until the plan has issued `layer`'s reads (re-raising what issuing the plan raised)."""
        plan = self._plan
        if plan is None:
            return
        with self._planned_cv:
            self._planned_cv.wait_for(lambda: self._planned >= layer)
        if plan.done() and plan.exception() is not None:
            plan.result()

    def plan_period(self, first: int, chosen: np.ndarray) -> None:
        """ContiguousKV's reads once a period's first layer chose its chunks (docs/systems.md).

        Intra-period: the set's K/V for every layer of the period, waiting only until the first `sp` layers
        have arrived. Inter-period: the next period's first-layer keys, and this set speculatively for the
        next period's layers; once that period chooses its own set only the difference is read.
        """
        pf, system, num_layers = self.path.prefetcher, self.path.system, self.path.num_layers
        p, sp = system.period_layers, system.subperiod_layers
        tickets = []
        for layer in range(first, min(first + p, num_layers)):
            for kind in (V,) if layer == first else (K, V):
                ticket = self._request(layer, kind, chosen)
                if layer < first + sp:
                    tickets.append(ticket)
        following = first + p
        if following < num_layers:
            self._request(following, K, self.all_positions)
            for layer in range(following, min(following + p, num_layers)):
                for kind in (V,) if layer == following else (K, V):
                    self._request(layer, kind, chosen, speculative=True)
                self.prefetched[layer] = chosen
        self.clock.timed("kv_io_stall", pf.wait, tickets)

    def credit(self, layer: int, kind: int, positions: np.ndarray, importance: np.ndarray) -> None:
        """Feed `importance` (per position) of `positions` to their cached chunks without reading them again."""
        cache = self.path.cache
        if cache is None:
            return
        chunks = self.locate(layer, positions).chunks
        kind = self.path.precision.kind(kind)
        for chunk in np.unique(chunks):
            cache.feedback((layer, kind, int(chunk)), importance=float(importance[chunks == chunk].sum()))

    def after_selection(self, layer: int, chosen: np.ndarray) -> None:
        """The layer's token set is loaded and its compute dispatched: keep what the speculation made for it
        guessed (scored after the first token, `after_first_token`), then, off this thread (`_read_ahead_of`),
        queue the guess of the next layer's selection (spec) while this one computes. (Certain reads were all
        planned at the request's start.)"""
        events.emit("selection", io=self, layer=layer, chosen=chosen)
        self._account_chosen()
        self._join_ahead()
        if self.path.speculator is not None:
            self.path.speculator.observe_selection(self._selection_disk_bytes.pop(layer, 0))
        self._selected.append((layer, chosen, self.prefetched.pop(layer, None), self._behind.pop(layer, [])))
        self._read_ahead_of(layer, chosen)

    def after_first_token(self) -> None:
        """What each layer's selection tells, kept off the path to the first token since nothing in this request
        depends on it: which chunks the layer needed, for later requests' speculation (`ChunkUsage`), and how what
        was read ahead for it did (`prefetch_report`)."""
        selected, self._selected = self._selected, []
        speculator = self.path.speculator
        for layer, chosen, guess, behind in selected:
            if speculator is not None:
                speculator.usage.record(layer, self.locate(layer, self.all_positions).unique_chunks(),
                                        self.locate(layer, chosen).unique_chunks())
            if guess is None:
                continue
            ahead = np.setdiff1d(guess, np.concatenate(behind)) if behind else guess
            self.stats["issued"] += len(guess)
            self.stats["ahead"] += len(ahead)
            self.stats["needed"] += len(chosen)
            self.stats["used"] += len(np.intersect1d(ahead, chosen))
            self.stats["guess_hits"] += len(np.intersect1d(guess, chosen))

    def _read_ahead_of(self, layer: int, chosen: np.ndarray) -> None:
        """The guess of layer + 1's selection, issued by the engine's I/O worker while this thread goes on to the next
        layer: the host work of choosing and queueing it stays off the path to the first token. Joined before the
        next layer's K/V are taken (`_join_ahead`). No guess where one does not pay for its host time
        (`Speculator.pays`): the layer then reads its set on demand, and nothing is handed to the worker (on a busy
        host, the hand-over and the join cost the request's thread more than the check does)."""
        speculator = self.path.speculator
        if speculator is None or layer + 1 >= self.path.num_layers or not len(chosen):
            return
        if not speculator.pays():
            self.stats["unpaid_layers"] += 1
            return
        self.stats["guessed_layers"] += 1
        if self.path.io_worker is None:
            self._speculate(layer + 1, chosen)
        else:
            self._ahead = self.path.io_worker.submit(self._speculate, layer + 1, chosen)

    def _join_ahead(self) -> None:
        """Wait until the reads queued by the last `after_selection` are issued (re-raising what they raised)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.result()

    def _speculate(self, layer: int, previous: np.ndarray) -> None:
        """SPEC's guess of `layer`'s selection from the previous layer's set (specjax.engine.speculation), read at
        speculative priority as far as the disk's budget goes and in the background beyond it; a guessed chunk the
        layer does not need is withdrawn when its K/V are taken unless the disk has already read it (`_read_ahead_of`
        decides whether to guess)."""
        speculator = self.path.speculator
        opened = self._window_opened[layer] = time.perf_counter()
        kinds = self._selection_kinds
        now, background = speculator.chunks(self.locate, layer, previous, kinds)  # chunk ids of `layer`
        for kind in kinds:
            self.path.prefetcher.request(self.match, layer, kind, chunks=now, background=background,
                                         speculative=True)
        guess = np.concatenate([now, background])
        chunks, chunk_of = self.locate(layer, self.all_positions).chunk_index
        self.prefetched[layer] = self.all_positions[np.isin(chunks, guess)[chunk_of]]
        speculator.observe_cost(time.perf_counter() - opened)

    def take(self, layer: int, kind: int, positions, pad_to: int, phase: str = "kv_io_stall", importance=None):
        """Vectors [heads, pad_to, d] of `positions` (zeros after them), waiting only for what is missing;
        `importance` (per position) feeds the attention-score cache. K and V are read at the request's precision
        and a low-bit kind's rows decoded on the device (`ReadPath.precision`)."""
        kind = self.path.precision.kind(kind)
        self._wait_planned(layer)
        self._kv_taken(layer, (kind,))
        taken, array, ranges = self.clock.timed(
            phase, take_decoded, self.path.prefetcher, self.match, layer, kind, positions,
            self.locate(layer, positions), pad_to, self.path.precision.decode, importance=importance)
        for got, of in ((taken, kind), (ranges, K_RANGE)):
            if got is None:
                continue
            if not got.ok.all():
                self.bad_chunk()
            if got.dispatched_at is not None:  # its gather: device work, whichever thread runs it
                self.clock.device_work(got.dispatched_at, got.array)
            if of in self._selection_kinds:  # what a guess of this layer could have read ahead
                self._selection_disk_bytes[layer] = (self._selection_disk_bytes.get(layer, 0) + got.chunks_from_disk
                                                     * self.path.store.layout.chunk_nbytes(of))
        return self.path.place_kv(array)

    def bad_chunk(self) -> None:
        """A read found a bad chunk: the request's reuse is abandoned (BadChunk). On a mesh over several processes
        the others found none, perhaps, and would go on with the layer's steps: this process goes on with them too,
        and every process learns at the end of the layer loop (`agree_on_bad_chunks`)."""
        if not self.path.processes:
            raise BadChunk()
        self._bad_chunk = True

    def agree_on_bad_chunks(self) -> None:
        """The end of the layer loop, on a mesh over several processes: BadChunk in every process if any found a bad
        chunk (every process must call this; one process: a bad chunk has raised already)."""
        if self.path.processes and distributed.any_process(self._bad_chunk):
            raise BadChunk()

    def take_chosen(self, layer: int, step: P.TakeChosen):
        """`step`'s kinds' rows gathered on the device from the caches' pages by the block table of every position of
        the layer (`Prefetcher.resident`), with no host step between the device's choice and the gather: the host
        waits only for the gathers' test (`step.when` and every row in a page) and, if it holds, hands the arrays
        back (None otherwise; nothing is counted then). The speculation's window and what its guess had read ahead
        are noted here, as a take notes them; what the takes would have counted, after the layer's compute is
        dispatched (`_account_chosen`)."""
        pf = self.path.prefetcher
        if pf is None:
            return None
        every = self.locate(layer, self.all_positions)
        kinds = tuple(map(self.path.precision.kind, step.kinds))
        residents, ranges = [], None
        try:
            for kind in kinds:
                resident = pf.resident(layer, kind, every, self.m_pad)
                if resident is None:
                    return None
                residents.append(resident)
            if any(map(in_chunk_range, kinds)):  # low-bit K decodes with its chunks' ranges: every chunk's, whole
                ranges = self._resident_ranges(layer, every)
                if ranges is None:
                    return None
            dispatched = time.monotonic()
            # the device step's choice, as this process's device that holds the pages has it
            rows, count, holds = map(distributed.local_replica, (step.rows, step.count, step.when))
            arrays = []
            for resident in residents:
                array, holds = pf.pool.gather_rows(resident.kind, resident.table, rows, count, holds)
                arrays.append(array)
            decoding = None
            if ranges is not None:
                resident, whole, n, chunk_of = ranges
                array, holds = pf.pool.gather_rows(K_RANGE, resident.table, whole, n, holds)
                decoding = (array, _chunk_of_rows(chunk_of, rows))
                arrays.append(array)
            self.clock.device_work(dispatched, arrays)
            if not bool(self.clock.device_wait(holds)):
                return None
            self._chosen_takes.append((residents, step.rows, step.count))
            if ranges is not None:
                self._chosen_takes.append(([ranges[0]], ranges[1], ranges[2]))
            residents, ranges = [], None
            self._kv_taken(layer, kinds)
            return tuple(self.path.place_kv(self.path.precision.decode(kind, array, decoding))
                         for kind, array in zip(kinds, arrays))
        finally:
            for resident in residents + ([ranges[0]] if ranges is not None else []):
                pf.discard(resident)

    def _resident_ranges(self, layer: int, every: Locations):
        """(the block table of the range rows of every chunk of `every`, whole; the rows to gather, as many as a host
        take pads them to; how many of them are the chunks'; each position's chunk among them, int32 [m_pad]) for a
        take of low-bit K on the device (`take_chosen`); None where they are in no page the device reads."""
        chunks, chunk_of = every.chunk_index
        ct = self.path.store.layout.chunk_tokens
        whole = Locations.whole(chunks, ct)
        size = range_rows(len(chunks), ct)
        resident = self.path.prefetcher.resident(layer, K_RANGE, whole, size)
        if resident is None:
            return None
        return resident, np.arange(size, dtype=np.int32), len(whole.chunks), padded(chunk_of, self.m_pad, 0)

    def _kv_taken(self, layer: int, kinds) -> None:
        """The layer's `kinds` are being taken. Of them, those a guess reads (the selection's kinds; not probe keys,
        keys taken whatever the layer selects, or spec_mixed's rest): the guess is issued by now, the speculation's
        window closes, and what the guess had not got on its way is noted (`_note_behind`)."""
        kinds = [kind for kind in kinds if kind in self._selection_kinds]
        if not kinds:
            return
        self._join_ahead()
        opened = self._window_opened.pop(layer, None)
        if opened is not None:
            self.path.speculator.observe_window(opened)
        if layer in self.prefetched:
            for kind in kinds:
                self._note_behind(layer, kind)

    def _account_chosen(self) -> None:
        """What the takes made on the device (`take_chosen`) would have counted as takes: the uses and hits of the
        chunks, the layer's open tickets let go; every slot they pinned is unpinned, whatever fails."""
        done, self._chosen_takes = self._chosen_takes, []
        try:
            for residents, rows, count in done:
                positions = np.asarray(rows)[:count]
                for resident in residents:
                    self.path.prefetcher.took_resident(resident, positions)
        finally:
            self._discard_chosen(done)

    def _discard_chosen(self, done: list) -> None:
        """Unpin the slots of takes made on the device (`_chosen_takes` entries)."""
        for residents, _, _ in done:
            for resident in residents:
                self.path.prefetcher.discard(resident)

    def _note_behind(self, layer: int, kind: int) -> None:
        """The layer's guessed positions whose `kind` chunk is not on its way as the layer takes it: they were not
        read ahead (`prefetch_report`'s `ahead`)."""
        guess = self.prefetched[layer]
        loc = self.locate(layer, guess)
        chunks = loc.unique_chunks()
        behind = chunks[~self.path.prefetcher.ahead(layer, kind, chunks)]
        if len(behind):
            self._behind.setdefault(layer, []).append(guess[np.isin(loc.chunks, behind)])

    def identify(self, fn, *args, **kwargs):
        """An identification step fn(*args, **kwargs), timed as "identify" once the device has done the work its
        inputs come from. That wait is the engine's pacing, not the clock's (an untimed engine waits too): without
        it the request's thread runs on to the next take while the device still computes, and on a CPU with few
        cores a selective system then makes more reads and takes longer (`benchmarks/results/cpu/data_path`)."""
        self.clock.device_wait(args)
        return self.clock.timed("identify", fn, *args, **kwargs)

    def take_all(self, layer: int, kind: int, phase: str = "kv_io_stall"):
        return self.take(layer, kind, self.all_positions, self.m_pad, phase)

    def select(self, policy, state, layer: int, q, own_k, n: int, k: int, k_cap: int) -> P.Selected:
        """Layer `layer`'s identification by `policy` (`specjax.engine.identify`): its steps carried out in the
        order it yields them, each one's result sent back, until it returns the layer's selection."""
        steps = policy.select(self.path.facts, P.Layer(layer, q, own_k, n, k, k_cap, self.m, self.m_pad,
                                                       self.all_positions), state)
        result, failed = None, True
        try:
            while True:
                result = self._carry_out(layer, steps.send(result))
        except StopIteration as done:
            failed = False
            return done.value
        finally:
            steps.close()
            try:
                self.let_go_certain(layer)
            except Exception:
                if not failed:  # else the layer's own error goes on (a bad chunk, recomputed), not the plan's
                    raise

    def _carry_out(self, layer: int, step):
        """One step of a layer's identification: a read, a device step of the decision (timed and paced, as
        `identify`), a scoring step (through a selection trace, if one is recorded or replayed), where positions lie,
        their chunks' key summaries, or ContiguousKV's feedback and period plan."""
        match step:
            case P.Take():
                positions = self.all_positions if step.positions is None else step.positions
                return self.take(layer, step.kind, positions, self.m_pad if step.pad_to is None else step.pad_to,
                                 step.phase, importance=step.importance)
            case P.TakeChosen():
                return self.take_chosen(layer, step)
            case P.Score():
                got = self.identify(step.fn, *step.args, **step.kwargs)
                scores, logits = got if step.logits else (got, None)
                hook = self.path.selections
                if hook is not None:
                    columns = self.all_positions if step.columns is None else step.columns
                    scores = hook.scores(layer, step.heads, step.role, columns, self.m, scores)
                return (scores, logits) if step.logits else scores
            case P.Decide():
                return self.identify(step.fn, *step.args, **step.kwargs)
            case P.Locate():
                return self.locate(layer, step.positions)
            case P.Summaries():
                got = self.clock.timed("probe_io", self.path.store.key_summaries, layer, step.chunks)
                if not got.ok.all():
                    self.bad_chunk()
                if self.path.processes:  # each process summarised its own heads' keys: joined, every head's
                    return distributed.join_parts(got.array[:, self.path.store.own_heads(K)], axis=1)
                return got.array
            case P.Credit():
                return self.credit(layer, step.kind, step.positions, step.importance)
            case P.PlanPeriod():
                return self.plan_period(layer, step.chosen)
        raise TypeError(f"an identification yielded {step!r}, which is no step (specjax.engine.identify)")

    def prefetch_report(self) -> dict:
        return prefetch_report(**self.stats)

    def close(self) -> None:
        try:
            if self._plan is not None:  # issued in full before the prefetcher lets go of its reads (a failure
                concurrent.futures.wait([self._plan])  # to issue it was raised by the take that needed it)
            self._join_ahead()
        finally:
            done, self._chosen_takes = self._chosen_takes, []
            self._discard_chosen(done)  # a request that failed before accounting for them
            if self.path.prefetcher is not None:
                self.path.prefetcher.close()
