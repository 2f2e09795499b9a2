"""The engine's systems (specjax.engine) behind the evaluation's System interface.

Every system, recompute included, runs through the same engine, so their TTFTs are measured the same way.
"""

from __future__ import annotations

import pathlib

import numpy as np

from specjax.engine import Request, fingerprint, make_engine, make_system
from specjax.engine import blend, processes, replay
from specjax.engine import systems as engine_systems
from specjax.engine.policies import Blend
from specjax.engine.precision import WithRest
from specjax.eval.systems import Outcome, SystemSettings
from specjax.stores import KVStore

class EngineSystem:
    """One engine system: populate/open a store, warm its caches, run requests."""

    def __init__(self, name: str, model, settings: SystemSettings):
        s = settings
        self.system = make_system(name, s.options)
        self.name = self.system.name
        self.needs_store = self.system.reuse
        self.chunk_tokens = self.system.chunk_tokens or settings.chunk_tokens  # contiguous_kv: its own
        self.model, self.settings = model, settings
        self.config = settings.engine
        self.system.schedule.check(self.config, self.chunk_tokens)  # a bad flag fails before any store is written
        self.store = None
        self.engine = None if self.needs_store else make_engine(model, self.system, None, self.config)
        self.base_repair_io: dict = {}  # what repairing the base store read and wrote (`repair`)
        self.selections = self._selection_trace()  # a bad trace fails before any store is written

    def _selection_trace(self) -> replay.Recorder | replay.Replay | None:
        """What identification records its scores into or replays them from (--record_selections,
        --replay_selections); None for systems that do not identify."""
        trace, s = self.settings.selections, self.settings
        if trace is None or not self.system.prunes:
            return None
        if trace.mode == "record":
            return replay.Recorder(replay.source_of(self.model, self.name, s.retention, trace.task,
                                                    trace.prefix_tokens))
        # a schedule may identify as another system does (the planner's loaded part as SPEC: its recording may have
        # computed every prefix, no scores); spec_mixed selects as SPEC does; NAME-kvB as NAME does
        stand_ins = [name for name in (self.system.schedule.identifies_as,) if name is not None]
        if self.system.rest_bits is not None:
            stand_ins.append("spec")
        if self.system.kv_bits is not None:
            stand_ins.append(self.name.replace(f"-kv{self.system.kv_bits}", "", 1))
        found = replay.Replay.find(trace.folder, [self.name, *stand_ins], s.retention)
        found.check(self.model, trace.task)
        return found.bind(self.model.config)

    @property
    def store_key(self) -> str:
        """Systems with the same key share one base store (the runner writes it once); the weights' short
        digest and the KV dtype keep the stores of other weights, or of the same weights cast, under one --store
        folder apart."""
        return f"prefixes-chunk{self.chunk_tokens}{self._bits()}-{self._kv_of()}"

    def _bits(self) -> str:
        """The low precisions the store holds K and V at besides the model's dtype (`System.store_bits`), if any."""
        bits = self.system.store_bits
        return f"-kv{'+'.join(map(str, bits))}" if bits else ""

    def _kv_of(self) -> str:
        """The store key's end: whose KV a store holds, `weights-<12 hex digits of the weights digest>-<KV dtype>`."""
        return f"weights-{self.model.weights_digest[:12]}-{np.dtype(self.model.dtype).name}"

    def _open_store(self, path: str, **kwargs) -> KVStore:
        return KVStore.open(path, fingerprint(self.model, self.chunk_tokens, self.system.store_bits), **kwargs)

    def populate(self, store_path: str, prefixes) -> dict:
        """Store every prefix not stored yet; {"written": n, "reused": n} (a store kept from an earlier run
        already holds some or all)."""
        store = processes.opened_in_turn(lambda: self._open_store(store_path))
        try:
            writer = make_engine(self.model, self.system, store, self.config)
            written = sum(writer.warm(prefix) for prefix in prefixes)
        finally:
            store.close()
        return {"written": written, "reused": len(prefixes) - written}

    def repair(self, store_path: str, sequences) -> int:
        """Drop what of `sequences` fails its checksum in the store at `store_path` and store it anew."""
        store = processes.opened_in_turn(lambda: self._open_store(store_path))
        try:
            engine = make_engine(self.model, self.system, store, self.config)
            dropped = engine.repair(sequences)
        finally:
            store.close()
        self.base_repair_io = engine.repair_io
        return dropped

    @property
    def repaired(self) -> list:
        """The stored sequences this system's store had to repair (their chunks failed their checksum)."""
        return [] if self.engine is None else list(dict.fromkeys(self.engine.repaired))

    @property
    def repair_io(self) -> dict:
        """What damaged stored KV cost the run beyond its own I/O: the reads and writes in its copy (warm-up and
        requests, `Engine.repair_io`) and in repairing the base store after it, and the damaged chunks its copy
        held (the base store's are the same chunks, found again)."""
        run = {} if self.engine is None else self.engine.repair_io
        both = (run, self.base_repair_io)
        return {"damaged_chunks": run.get("damaged_chunks", 0),
                "repair_disk_bytes": sum(c.get("disk_bytes", 0) for c in both),
                "repair_disk_bytes_written": sum(c.get("disk_bytes_written", 0) for c in both)}

    def open(self, store_path: str) -> None:
        self.store = processes.opened_in_turn(lambda: self._open_store(
            store_path, direct_io=self.settings.direct_io, disk_bandwidth=self.settings.disk_bandwidth,
            max_inflight_bytes=self.settings.inflight_bytes))
        self.engine = make_engine(self.model, self.system, self.store, self.config, selections=self.selections)

    def warm(self, requests) -> None:
        """Compile every shape the run will use and fill the caches (`warm_up`; the planner measures each of its
        plans on them there, `PlannerEngine.calibrate`)."""
        warm_up(self.engine, [r.engine_request() for r in requests])

    @property
    def precision(self) -> dict | None:
        """The bits of a loaded prefix token's K and V elements: the selected tokens' (or every loaded token's) and
        the rest's (None: not loaded; `rest_key_bits` where the rest's keys load at other bits than its values), and
        the planner's other precisions (`plan_bits`, planner-planB: which of them each request loaded at is
        `planner.bits_counts`); None for a system that loads none."""
        if not self.system.reuse:
            return None
        full = 8 * np.dtype(self.model.dtype).itemsize
        out = {"selected_bits": self.system.kv_bits or full, "rest_bits": self.system.rest_bits}
        identification = getattr(self.engine, "identification", None)
        if isinstance(identification, WithRest):
            keys = identification.rest_key_bits(self.engine.facts) or out["selected_bits"]  # None: the selection's
            if keys != out["rest_bits"]:
                out["rest_key_bits"] = keys
        return {**out, "plan_bits": list(self.system.plan_bits)} if self.system.plan_bits else out

    def summary(self) -> dict | None:
        """What the run's system measured beyond its requests: the planner's cost model (None for the others)."""
        return self.engine.model_summary() if hasattr(self.engine, "model_summary") else None

    def run(self, request) -> Outcome:
        return _outcome(self.engine.run(request.engine_request()), request)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        if isinstance(self.selections, replay.Recorder):
            folder = pathlib.Path(self.settings.selections.folder)
            self.selections.save(folder / replay.trace_name(self.name, self.settings.retention))


class BlendSystem(EngineSystem):
    """full_reuse / cacheblend: a base store of independently cached text chunks (a request's `chunk_ids`;
    the whole prefix as one chunk for tasks without chunks), each context's first segment stored whole and
    every later chunk computed after the model's sink token (specjax.engine.blend)."""

    @property
    def store_key(self) -> str:
        return f"text_chunks-sink-chunk{self.chunk_tokens}{self._bits()}-{self._kv_of()}"

    def _open_store(self, path: str, **kwargs) -> KVStore:
        return KVStore.open(path, blend.blend_fingerprint(self.model, self.chunk_tokens, self.system.store_bits),
                            **kwargs)

    def stored_sequences(self, requests) -> list[tuple[int, ...]]:
        """What the base store holds: the store key of every distinct chunk of the requests (the first segment
        itself, a later chunk after the sink), in order of first use."""
        sink = blend.chunk_sink(self.model.config)
        keys = [tuple(k) for r in requests
                for k in blend.chunk_keys([c for c in (getattr(r, "chunk_ids", ()) or (r.prefix_ids,)) if c], sink)]
        return list(dict.fromkeys(keys))

    def run(self, request) -> Outcome:
        r = self.engine.run(request.engine_request())
        outcome = _outcome(r, request)
        outcome.layers["recomputed"] = [float(x) for x in r.layers["recomputed"]]
        outcome.counters["recomputed_tokens"] = float(np.mean(r.layers["recomputed"]) * len(request.prefix_ids))
        return outcome


def warm_up(engine, requests: list[Request]) -> None:
    """The warm-up every measured engine gets: two passes over `requests` (one per distinct prefix, in arrival
    order). Systems that reorder repack the store between the passes (from the importance the first pass
    observed; the repack frees the old chunks, and the caches drop them), so the second pass places the repacked
    chunks; every system gets both passes, so their caches see the same warm-up traffic.

    The planner measures its plans (`PlannerEngine.calibrate`) on the store as the timed requests find it, after the
    repack (before it the important tokens do not share chunks yet, and SPEC's plan reads several times the bytes),
    on caches of its own: its caches and speculation are then spec's. (They matter: what the caches hold and what
    speculation reads change a request's bytes, so a calibration that emptied the planner's caches would misjudge its
    SPEC plan's cost; `benchmarks/results/cpu/planner-piqa40-prefix1024-scratchcal`.)"""
    for r in requests:
        engine.run(r)
    if engine.system.reorder:
        _observe_repaired(engine, requests)
        engine.reorder()
    if hasattr(engine, "calibrate"):
        engine.calibrate(requests)
    for r in requests:
        engine.run(r)


def _observe_repaired(engine, requests: list[Request]) -> None:
    """A prefix the first pass stored anew (a chunk of it failed its checksum) holds no importance: the request
    that met the damage was recomputed. Its first-pass requests run again on the repaired store, so that the
    reordering repacks it as it repacks the others."""
    repaired = set(getattr(engine, "repaired", ()))  # an engine stand-in may keep none
    if not repaired:
        return
    for r in requests:
        if any(tuple(key) in repaired for key in engine.stored_keys(r)):
            engine.run(r)


def _outcome(r, request) -> Outcome:
    logprobs = [lp for lp, _ in r.continuation_logprobs]
    greedy = [g for _, g in r.continuation_logprobs]
    return Outcome(logprobs, greedy, r.ttft_ms, r.breakdown_ms, _counters(r, len(request.prefix_ids)), _layers(r))


def _counters(r, prefix_tokens: int) -> dict:
    io = r.io
    jaccard = np.asarray(r.layers["jaccard"], np.float64)
    measured = ~np.isnan(jaccard)
    fallback = np.asarray(r.layers["fallback"], bool)
    p = r.prefetch
    retained = np.asarray(r.layers["retained"], np.float64)
    return {
        "disk_bytes": io.get("disk_bytes", 0), "host_to_device_bytes": io.get("host_to_device_bytes", 0),
        "device_page_bytes": io.get("device_page_bytes", 0),
        "chosen_on_device_bytes": io.get("chosen_on_device_bytes", 0),
        "chunks_read": io.get("chunks_read", 0), "used_token_bytes": io.get("used_token_bytes", 0),
        "read_requests": io.get("read_requests", 0), "host_to_device_transfers": io.get("host_to_device_transfers", 0),
        "cache_lookups": io.get("device_hits", 0) + io.get("host_hits", 0) + io.get("misses", 0),
        "device_hits": io.get("device_hits", 0), "host_hits": io.get("host_hits", 0),
        "itf_layers": int(measured.sum()), "itf_fallbacks": int((fallback & measured).sum()),
        "jaccard_sum": float(jaccard[measured].sum()),
        # prefetch_report's counts (its ratios are made again from the run's totals)
        **{key: value for key, value in p.items() if key.startswith("prefetch_")},
        "prefix_tokens": prefix_tokens, "reused_tokens": r.reused_tokens,
        "retained_tokens": float(np.nanmean(retained) * r.reused_tokens) if r.reused_tokens else 0.0,
        "bad_chunks": io.get("bad_chunks", 0) + int(r.recomputed_bad_chunks),
        # beside disk_bytes, not in it: what damaged stored KV made the request read and write
        "repair_disk_bytes": r.repair_io.get("disk_bytes", 0),
        "repair_disk_bytes_written": r.repair_io.get("disk_bytes_written", 0),
        "probe_disk_bytes": io.get("probe_disk_bytes", 0),
        # tensor parallel: what each device's reader read of its own heads
        **{f"device{i}_disk_bytes": n for i, n in enumerate(r.disk_bytes_by_device)},
        **_split_counters(r),
        **_plan_counters(r),
        **({} if r.host_exposed_ms is None else {"host_exposed_ms": r.host_exposed_ms}),
        **({} if r.cpu_ms is None else {"cpu_ms": r.cpu_ms}),
    }


def _plan_counters(r) -> dict:
    """The planner: how the request's stored prefix was loaded, what the caches held of it, the predicted TTFT."""
    if r.plan is None:
        return {}
    out = {"planned_load_all": float(r.plan["load_all"]), "planned_bits": float(r.plan["bits"]),
           "planned_held_share": r.plan["held_share"]}
    return out if r.plan["predicted_ttft_ms"] is None else {**out, "predicted_ttft_ms": r.plan["predicted_ttft_ms"]}


def _split_counters(r) -> dict:
    """Cake: stored prefix tokens computed on the device instead of loaded (the rest of reused_tokens was loaded)."""
    return {} if r.split is None else {"computed_prefix_tokens": r.split["computed_prefix_tokens"]}


def _layers(r) -> dict:
    if not r.reused_tokens:
        return {}
    layers = {"retained": [float(x) for x in r.layers["retained"]],
              "fallback": [1.0 if f else 0.0 for f in r.layers["fallback"]]}
    for key in ("jaccard", "head_share"):  # measured only by systems that identify with probe heads (spec_gqa's
        values = np.asarray(r.layers.get(key, [np.nan]), np.float64)  # guard: grouped-query models)
        if not np.isnan(values).any():
            layers[key] = values.tolist()
    return layers


def factories() -> dict:
    """name -> factory(model, settings) for every system the engine builds."""
    def factory(name):
        cls = BlendSystem if isinstance(engine_systems.SYSTEMS[name].schedule, Blend) else EngineSystem
        return lambda model, settings: cls(name, model, settings)

    return {name: factory(name) for name in engine_systems.SYSTEMS}
