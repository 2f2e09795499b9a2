"""The systems a run compares, behind one small interface, and the `recompute` baseline.

A system is built by `factory(model, settings)` and then driven by the runner:

    system.needs_store                       # False: never touches the store (recompute)
    system.populate(store_path, prefixes)    # once, on one instance: write every prefix's KV
    system.open(store_path)                  # this run's private copy of that base store
    system.warm(requests)                    # fill caches (same warm-up for every system)
    system.run(request) -> Outcome           # one request; times its own TTFT
    system.close()

`request` is a `specjax.eval.workload.Request` (prefix_ids, query_ids, choice_ids, ...).
`run` returns an `Outcome`, or any object / mapping with the same field names, so the
engine (specjax, which must not import eval) can return a plain dict. The engine's systems
are built by `specjax.eval.engine_systems`; `specjax.eval.registry` names every system a run can compare.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from specjax.engine.systems import SystemOptions
from specjax.engine.types import EngineConfig
from specjax.stores import Layout

BREAKDOWN_KEYS = ("probe_io", "identify", "kv_io_stall", "compute")

# Counters a system may report per request (missing ones count as 0). Ratios in results.json
# are computed from their sums over the run:
#   read_amplification = disk_bytes / used_token_bytes     (bytes read / bytes of tokens used)
#   device_hit_ratio = device_hits / cache_lookups; host_hit_ratio = host_hits / cache_lookups
#   fallback_ratio = itf_fallbacks / itf_layers; mean_jaccard = jaccard_sum / itf_layers
#   prefetch precision = prefetch_used / prefetch_ahead; recall = prefetch_used / prefetch_needed;
#   guess_recall = prefetch_guess_hits / prefetch_needed (specjax.engine.speculation.prefetch_report);
#   prefetch_guessed_layers / prefetch_unpaid_layers: layers whose next layer was guessed, or was not because a guess
#   would not have paid for its host time (speculation's `Speculator.pays`)
#   chosen_on_device_share = chosen_on_device_bytes / used_token_bytes: the used rows a device step chose that the
#   device took from the caches' pages with no host step between (`identify.TakeChosen`)
#   cake's computed_fraction = computed_prefix_tokens / reused_tokens (stored prefix computed, not loaded)
#   bytes_per_read = disk_bytes / read_requests; read_requests / host_to_device_transfers are also given per request
#   compilations: XLA compiles during the request, counted by the runner (compilations_timed is their sum)
#   predicted_ttft_ms: the planner's prediction of the request's TTFT (its plan's; planner.prediction_error_median)
#   planned_load_all: the planner loaded the whole stored prefix (1) or selected from it (0);
#   planned_bits: the bits its plan loaded K and V at (0: the system's precision; planner-planB)
#   planned_held_share: the share of the stored tokens its plan loaded that the cache tiers held when it was planned
#   cpu_ms: the process's CPU time, every thread's, from the request's start to its first token (cpu_ms per request)
#   recomputed_tokens: cacheblend / full_reuse, the context tokens recomputed per layer, averaged over the layers
#   repair_disk_bytes / repair_disk_bytes_written: what damaged stored KV made the request read (an attempt given up
#   at a bad chunk, the repair's checks) and write (the repair), counted apart from disk_bytes, the system's own reads
COUNTER_KEYS = (
    "disk_bytes", "probe_disk_bytes", "host_to_device_bytes", "device_page_bytes", "chunks_read", "used_token_bytes",
    "chosen_on_device_bytes", "read_requests",
    "host_to_device_transfers",
    "cache_lookups", "device_hits", "host_hits",
    "itf_layers", "itf_fallbacks", "jaccard_sum",
    "prefetch_issued", "prefetch_ahead", "prefetch_used", "prefetch_needed", "prefetch_guess_hits",
    "prefetch_guessed_layers", "prefetch_unpaid_layers",
    "prefix_tokens", "reused_tokens", "retained_tokens", "bad_chunks", "repair_disk_bytes", "repair_disk_bytes_written",
    "computed_prefix_tokens", "compilations", "host_exposed_ms", "cpu_ms", "predicted_ttft_ms",
    "recomputed_tokens",
    "planned_load_all", "planned_bits", "planned_held_share",
)
DEVICE_COUNTER = re.compile(r"device\d+_disk_bytes")  # tensor parallel: one per device of the mesh


def device_bytes(counters: Mapping[str, float]) -> list[float]:
    """The per-device disk bytes among `counters`, in device order (empty without split reads)."""
    found = {int(k[len("device"):-len("_disk_bytes")]): v for k, v in counters.items() if DEVICE_COUNTER.fullmatch(k)}
    return [found.get(i, 0.0) for i in range(max(found) + 1)] if found else []


@dataclasses.dataclass
class Outcome:
    """What one request produced."""

    choice_logprobs: list[float]  # sum log p(continuation | prefix + query) per choice
    choice_greedy: list[bool]  # is each continuation the greedy one
    ttft_ms: float  # arrival -> first-token logits ready (block_until_ready)
    breakdown_ms: dict[str, float]  # BREAKDOWN_KEYS; sums to about ttft_ms
    counters: dict[str, float] = dataclasses.field(default_factory=dict)  # COUNTER_KEYS
    # per-layer records, lists of num_layers floats: "retained" (kept / prefix tokens),
    # "fallback" (1.0 if ITF fell back), "jaccard", "head_share" (spec_gqa's guard); empty when the system has none
    layers: dict[str, list[float]] = dataclasses.field(default_factory=dict)


def check_counters(counters: Mapping[str, float]) -> None:
    """One vocabulary from the engine to results.json: a counter it does not know is a bug, not a new name."""
    unknown = sorted(k for k in set(counters) - set(COUNTER_KEYS) if not DEVICE_COUNTER.fullmatch(k))
    if unknown:
        raise TypeError(f"system outcome has unknown counters {unknown}; known: {', '.join(COUNTER_KEYS)}")


def as_outcome(x: Any) -> Outcome:
    """Accept an Outcome, a mapping or any object with Outcome's fields (its counters checked in each case)."""
    if isinstance(x, Outcome):
        check_counters(x.counters)
        return x
    get = x.get if isinstance(x, Mapping) else (lambda k, d=None: getattr(x, k, d))
    missing = [k for k in ("choice_logprobs", "choice_greedy", "ttft_ms") if get(k) is None]
    if missing:
        raise TypeError(f"system outcome lacks {missing}")
    check_counters(get("counters") or {})
    return Outcome(
        [float(v) for v in get("choice_logprobs")], [bool(v) for v in get("choice_greedy")],
        float(get("ttft_ms")), {k: float(v) for k, v in (get("breakdown_ms") or {}).items()},
        {k: float(v) for k, v in (get("counters") or {}).items()},
        {k: [float(u) for u in v] for k, v in (get("layers") or {}).items()},
    )


@dataclasses.dataclass(frozen=True)
class SelectionTrace:
    """Record identification's scores into, or replay them from, a folder of selection traces (one file per
    system and retention; specjax.engine.replay). `task` / `prefix_tokens`: the run's, kept with a recording and
    checked against a replay."""

    mode: str  # "record" or "replay"
    folder: str
    task: str
    prefix_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class SystemSettings:
    """What a run hands its system, resolved from the evaluation's settings (`specjax.eval.settings`: sizes in bytes,
    rates in bytes/s); recorded in results.json under config.resolved. The engine's own settings are its
    `EngineConfig`, whole (retention, cache budgets, the emulated PCIe link, kernels, Cake's and chunked prefill's
    chunks); the rest is the store's and the run's."""

    engine: EngineConfig = EngineConfig()
    chunk_tokens: int = Layout.chunk_tokens  # the store's default chunk
    disk_bandwidth: float | None = None  # bytes/s, emulated (token bucket) when set
    direct_io: bool = False
    inflight_bytes: int | None = None  # the read scheduler's bound on bytes in flight (None: its default)
    seed: int = 0
    options: SystemOptions = SystemOptions()  # what the user changed about the systems (their flags)
    selections: SelectionTrace | None = None  # systems that identify record or replay their selections

    @property
    def retention(self) -> float:
        """The share of the stored prefix a pruning system keeps (the engine's)."""
        return self.engine.retention

    def at_retention(self, retention: float) -> "SystemSettings":
        """These settings for one run of a retention sweep."""
        return dataclasses.replace(self, engine=dataclasses.replace(self.engine, retention=retention))


class System(Protocol):
    name: str  # the name it was registered under, and after a "-" the options it was built with, if any
    needs_store: bool

    def populate(self, store_path: str, prefixes: Sequence[Sequence[int]]) -> None: ...
    def open(self, store_path: str) -> None: ...
    def warm(self, requests: Sequence[Any]) -> None: ...
    def run(self, request: Any) -> Outcome | Mapping: ...
    def close(self) -> None: ...
