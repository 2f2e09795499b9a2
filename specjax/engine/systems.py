"""The systems compared on the one engine, as policies: what a layer loads, what is prefetched, how caches score.

A system is data, not a copy of the engine; `make_system` applies what a user may change about one
(`SystemOptions`: SPEC's ablation switches, ContiguousKV's sizes, CacheBlend's settings, ...).
"""

from __future__ import annotations

import dataclasses

from specjax.connector import CACHE_POLICIES, LOW_BITS
from specjax.engine import policies
from specjax.engine.identify import POLICIES as IDENTIFY
from specjax.engine.identify import trait
from specjax.engine.policies import BLEND_DEVIATIONS, BLEND_FILTERS, CERTAIN, NO_PREFETCH, PERIODS, SPECULATIVE
from specjax.engine.policies import Blend, Cake, Layers, Planner, Prefetch, Schedule
from specjax.errors import SpecjaxError

# How a layer chooses its tokens (`IDENTIFY`, specjax.engine.identify's policies by name): load all | per-head H2O |
# SPEC's ITF | ContiguousKV's chunks | spec_gqa's ITF over KV-head probes | any a new file registers.
# What is read ahead and how requests are scheduled: `specjax.engine.policies`.


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    reuse: bool = True  # False: recompute the whole prefix, never touch the store
    identify: str = "none"
    # what is read for layer i+1 while layer i computes (a `policies.Prefetch`; its name is read as one)
    prefetch: Prefetch = NO_PREFETCH
    cache_policy: str = "lru"  # stores.caches policy of the device and host tiers
    reorder: bool = False  # repack each radix node's chunks by importance between requests
    alpha: float = 0.6  # ITF threshold exponent, t = j ** alpha
    num_probe_heads: int = 3
    chunk_tokens: int | None = None  # the store chunk this system needs (None: the run's --chunk_tokens)
    period_layers: int = 8  # "chunks": layers sharing the chunk set chosen at the period's first layer
    subperiod_layers: int = 4  # "periods" prefetch: layers of a period loaded before the period computes
    schedule: Schedule = Layers()  # what runs its requests (`policies`: Layers, Cake, Planner, Blend)
    # spec_gqa: only the chunks whose key summaries bound the most attention, at least this many times the kept
    # tokens, are scored and read (None: every position)
    candidates: float | None = None
    # spec_gqa on grouped-query models: a shared set must keep at least this share of every query head's own
    # top-k attention, else the layer falls back (None: SPEC's test alone)
    min_head_share: float | None = None
    # prefix K and V loaded at these bits, from a store that holds them so (None: the store's dtype; specjax.engine.
    # precision)
    kv_bits: int | None = None
    # the prefix tokens the identification does not select load at these bits instead of being dropped (spec_mixed)
    rest_bits: int | None = None
    # ... and their keys at these (None: rest_bits): a key's rounding moves the answers more than a value's
    rest_key_bits: int | None = None
    description: str = ""  # one line, for --help and the reports

    def __post_init__(self):
        object.__setattr__(self, "prefetch", policies.prefetch(self.prefetch))
        if not isinstance(self.schedule, Schedule):
            raise SpecjaxError(f"system {self.name!r}: schedule must be a specjax.engine.policies.Schedule, got "
                               f"{self.schedule!r}")
        for field, value, known in (("identify", self.identify, IDENTIFY), ("cache_policy", self.cache_policy,
                                                                              CACHE_POLICIES)):
            if value not in known:
                raise SpecjaxError(f"system {self.name!r}: unknown {field} {value!r}; choose one of "
                                   f"{', '.join(known)}")
        if self.candidates is not None and not self.candidates >= 1.0:
            raise SpecjaxError(f"system {self.name!r}: candidates must be at least 1 (x the kept tokens), got "
                               f"{self.candidates}")
        if self.min_head_share is not None and not 0.0 < self.min_head_share <= 1.0:
            raise SpecjaxError(f"system {self.name!r}: min_head_share must be in (0, 1], got {self.min_head_share}")
        for field, bits in (("kv_bits", self.kv_bits), ("rest_bits", self.rest_bits),
                            ("rest_key_bits", self.rest_key_bits)):
            if bits is not None and bits not in LOW_BITS:
                raise SpecjaxError(f"system {self.name!r}: {field} must be one of {LOW_BITS}, got {bits}")
        if self.rest_bits is not None and not self.prunes:
            raise SpecjaxError(f"system {self.name!r}: rest_bits loads the tokens an identification leaves out; "
                               f"this system identifies none")
        if self.rest_key_bits is not None and self.rest_bits is None:
            raise SpecjaxError(f"system {self.name!r}: rest_key_bits is the bits of a rest's keys; it loads no rest "
                               f"(rest_bits)")
        if self.rest_bits is not None and self.rest_bits == self.kv_bits:
            raise SpecjaxError(f"system {self.name!r}: its selection and the rest both at {self.kv_bits} bits load "
                               f"every token at them: run a system that loads everything at kv_bits instead")
        if isinstance(self.schedule, Planner) and any(b not in LOW_BITS for b in self.schedule.bits):
            raise SpecjaxError(f"system {self.name!r}: the planner's precisions must be some of {LOW_BITS}; got "
                               f"{self.schedule.bits}")
        if self.rest_bits is not None and self.candidates is not None:
            raise SpecjaxError(f"system {self.name!r}: rest_bits with a candidate stage is not built (the rest's "
                               f"rows are laid over every position's)")
        if self.prefetch.periods != trait(self.identify, "periods"):
            raise SpecjaxError(f"system {self.name!r}: 'periods' prefetch goes with 'chunks' identification only")

    @property
    def prunes(self) -> bool:
        """It keeps a share of the stored prefix (`--retention`): accuracy and TTFT depend on the retention."""
        return trait(self.identify, "prunes")

    @property
    def store_bits(self) -> tuple[int, ...]:
        """The low precisions its store must hold K and V at (`kv_bits`, `rest_bits`, `rest_key_bits`,
        `plan_bits`)."""
        bits = (self.kv_bits, self.rest_bits, self.rest_key_bits, *self.plan_bits)
        return tuple(sorted({b for b in bits if b is not None}, reverse=True))

    @property
    def plan_bits(self) -> tuple[int, ...]:
        """The planner's low precisions (`policies.Planner.bits`); () for every other schedule."""
        return self.schedule.bits if isinstance(self.schedule, Planner) else ()


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System("recompute", reuse=False,
               description="full prefill of prefix + query (ReComp)"),
        System("as_full", identify="none", prefetch=CERTAIN, cache_policy="lru",
               description="AttentionStore-like: load all prefix KV, LRU caches"),
        System("as_h2o_lru", identify="h2o", prefetch=CERTAIN, cache_policy="lru",
               description="AS + H2O: all keys, important values, LRU"),
        System("as_h2o_lfu", identify="h2o", prefetch=CERTAIN, cache_policy="lfu",
               description="AS + H2O: all keys, important values, LFU"),
        System("impress", identify="itf", prefetch=CERTAIN, cache_policy="spec_score", reorder=True,
               description="IMPRESS: probe-head keys, important KV, score cache"),
        System("spec", identify="itf", prefetch=SPECULATIVE, cache_policy="spec_score", reorder=True,
               description="SPEC: IMPRESS + layer-aware speculative prefetch"),
        # SPEC whose selection's chunks are loaded whole and the other chunks' tokens at low precision instead of
        # dropped, their values at 4 bits and their keys at 8 (specjax.engine.precision; why 8: docs/systems.md)
        System("spec_mixed", identify="itf", prefetch=SPECULATIVE, cache_policy="spec_score", reorder=True,
               rest_bits=4, rest_key_bits=8,
               description="SPEC loading the chunks its selection touches whole and the others at low precision "
                           "(--rest_bits, --rest_key_bits)"),
        # grouped-query-aware identification: probes are KV heads, every query head keeps 90% of its
        # own top-k's attention under a shared set; candidates from key summaries of 16-token chunks (Quest's
        # pages; its own store) only when asked for (`candidates`)
        System("spec_gqa", identify="gqa_itf", prefetch=SPECULATIVE, cache_policy="spec_score", reorder=True,
               min_head_share=0.9, chunk_tokens=16,
               description="SPEC with KV-head probes and a per-query-head guard (grouped-query models)"),
        System("contiguous_kv", identify="chunks", prefetch=PERIODS, cache_policy="attention_score",
               chunk_tokens=16,
               description="ContiguousKV: 16-token chunks, periods, I x F cache"),
        System("cake", identify="none", cache_policy="lru", schedule=Cake(),
               description="Cake: compute from the front, load from the back"),
        # SPEC, computing per request the head of the stored prefix a cost model of measured rates says to (design
        # 5.2): head 0 is spec, the whole prefix recompute
        System("planner", identify="itf", prefetch=SPECULATIVE, cache_policy="spec_score", reorder=True,
               schedule=Planner(),
               description="SPEC computing the head of the prefix a cost model of measured rates picks"),
        # CacheBlend and its lower bound: every chunk's KV, re-rotated to its place; prefetch the next layer's KV
        System("cacheblend", prefetch=CERTAIN, cache_policy="lru", schedule=Blend(ratio=0.15),
               description="CacheBlend: reuse chunk KV, recompute deviating tokens (--blend_ratio)"),
        System("full_reuse", prefetch=CERTAIN, cache_policy="lru", schedule=Blend(ratio=0.0),
               description="reuse all cached chunk KV, re-rotated, no recompute (CacheBlend's lower bound)"),
    )
}


def system_names() -> list[str]:
    return list(SYSTEMS)


def register(system: System) -> System:
    """Add `system` to the registry under its name (a new system's one row: docs/development.md, "Adding a system"),
    so that `make_system`, `specjax.prefill_engine` and `python -m specjax.eval --systems` find it. A name already
    registered is refused."""
    if system.name in SYSTEMS:
        raise SpecjaxError(f"a system named {system.name!r} is registered already; pick another name")
    if "-" in system.name:
        raise SpecjaxError(f"system name {system.name!r}: '-' separates a system's name from its options")
    SYSTEMS[system.name] = system
    return system


# SPEC's ablations (paper Fig. 18): option no_NAME sets the System field to the value (AS+H2O+LFU's, the baseline's)
ABLATIONS = {"itf": ("identify", "h2o"), "reorder": ("reorder", False), "score_cache": ("cache_policy", "lfu"),
             "prefetch": ("prefetch", CERTAIN)}


def _option(default, help: str, choices: tuple[str, ...] | None = None):
    """A field of `SystemOptions`: its default and the help of the eval's flag of the same name."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclasses.dataclass(frozen=True)
class SystemOptions:
    """What a user may change about a registered system, one field per option. The eval's flag of the same name, its
    type, default and help, the run's recorded settings and `make_system`'s keywords are made from these fields, and
    `apply` gives each its effect, so an option is added here and nowhere else (docs/development.md, "Adding a
    system option").
    An option that does not concern a system leaves it as it is; None: the system's own value."""

    no_itf: bool = _option(False, "SPEC's ablation (systems identifying with ITF: impress, spec, spec_gqa, "
                                  "planner): no similarity-guided identification (Fig. 18).")
    no_reorder: bool = _option(False, "SPEC's ablation (as no_itf): no KV reordering.")
    no_score_cache: bool = _option(False, "SPEC's ablation (as no_itf): LFU (AS+H2O+LFU's, Fig. 18's baseline) "
                                   "instead of the score-based dual cache.")
    no_prefetch: bool = _option(False, "SPEC's ablation (as no_itf): no layer-aware speculative prefetch.")
    alpha: float | None = _option(None, "Systems that identify with ITF (impress, spec, spec_gqa, planner): the "
                                  "threshold exponent, t = j ** alpha (default: the system's own, 0.6; 0: t = 1, any "
                                  "disagreement falls back).")
    ckv_chunk_tokens: int | None = _option(None, "contiguous_kv: tokens per ContiguousChunk, its unit of scoring, "
                                           "storage, transfer and caching (c; default 16, the paper's). It gets a "
                                           "store of its own.")
    period_layers: int | None = _option(None, "contiguous_kv: layers sharing the chunk set chosen at a period's "
                                        "first layer (p; default 8).")
    subperiod_layers: int | None = _option(None, "contiguous_kv: layers of a period whose KV must arrive before the "
                                           "period computes (sp; default 4, at most p).")
    blend_ratio: float | None = _option(None, "cacheblend: mean fraction of context tokens recomputed per layer "
                                        "after its full check layers (default: CacheBlend's 15%); 1 recomputes "
                                        "everything.")
    blend_deviation: str | None = _option(None, "cacheblend: the deviation between recomputed and reused vectors "
                                          "that ranks tokens (value, the default: CacheBlend's vLLM code; key: "
                                          "LMCache's blender; key_value: the paper's KV deviation).",
                                          choices=BLEND_DEVIATIONS)
    blend_filter: str | None = _option(None, "cacheblend: each later layer keeps the most deviating part of the "
                                       "previous layer's set (gradual, the default: the paper) or recomputes the "
                                       "check layer's set on every layer (fixed, the authors' code).",
                                       choices=BLEND_FILTERS)
    always_speculate: bool = _option(False, "Systems with layer-aware speculative prefetch (spec, spec_gqa, "
                                     "planner): guess after every layer, as the SPEC paper does, not only where a "
                                     "guess pays for its host time (measured); each guess still reads the chunks "
                                     "its records and the disk's budget allow. Results name the system "
                                     "NAME-always_speculate.")
    gqa_candidates: float | None = _option(None, "spec_gqa: a candidate stage; only the chunks whose key summaries "
                                           "bound the most attention, at least this many times the kept tokens (at "
                                           "least 1), are read and scored; results name the system "
                                           "spec_gqa-candidatesB. 0 or unset: none (every position is a "
                                           "candidate).")
    kv_bits: int | None = _option(None, "Every system that reuses prefix KV: load K and V at 8, 4 or 2 bits (from a "
                                  "store holding them so, made for it) instead of the model's dtype; results name "
                                  "the system NAME-kvB.")
    rest_bits: int | None = _option(None, "spec_mixed: the bits (8, 4 or 2) the values of the chunks its "
                                    "selection does not touch load at (default 4); results name the system "
                                    "spec_mixed-restB.")
    rest_key_bits: int | None = _option(None, "spec_mixed: the bits (8, 4 or 2) the keys of the chunks its "
                                        "selection does not touch load at (default 8: a key's rounding moves the "
                                        "answers more than a value's, docs/systems.md); results name the system "
                                        "spec_mixed-restkB.")
    plan_bits: int | None = _option(None, "planner: the fewest bits (8, 4 or 2) it may load a stored prefix's K and "
                                    "V at, as its cost model says per request: it then weighs loading at every "
                                    "precision from this one up beside its other plans (the accuracy each costs: "
                                    "docs/systems.md); results name the system planner-planB.")

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value, choices = getattr(self, field.name), field.metadata["choices"]
            if choices is not None and value is not None and value not in choices:
                raise SpecjaxError(f"unknown {field.name} {value!r}; choose one of {', '.join(choices)}")
        for name in ("ckv_chunk_tokens", "period_layers", "subperiod_layers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SpecjaxError(f"{name} must be at least 1, got {value}")
        if self.blend_ratio is not None and not 0.0 <= self.blend_ratio <= 1.0:
            raise SpecjaxError(f"blend_ratio must be in [0, 1], got {self.blend_ratio}")
        if self.alpha is not None and not self.alpha >= 0:
            raise SpecjaxError(f"alpha must be >= 0 (0: the threshold is 1), got {self.alpha}")
        if self.always_speculate and self.no_prefetch:
            raise SpecjaxError("always_speculate and no_prefetch contradict each other: pick one")
        if self.gqa_candidates and not self.gqa_candidates >= 1:
            raise SpecjaxError(f"gqa_candidates must be 0 (no candidate stage) or at least 1 (x the kept tokens), "
                               f"got {self.gqa_candidates}")
        for name in ("kv_bits", "rest_bits", "rest_key_bits", "plan_bits"):
            if getattr(self, name) is not None and getattr(self, name) not in LOW_BITS:
                raise SpecjaxError(f"{name} must be one of {LOW_BITS}, got {getattr(self, name)}")

    def apply(self, system: System) -> System:
        """`system` at the precisions asked for (`kv_bits`, `rest_bits`, `rest_key_bits`: named first,
        `NAME-kvB-restC-restkD`), then with the other options (`_apply`)."""
        if self.kv_bits is not None and system.reuse:
            system = dataclasses.replace(system, kv_bits=int(self.kv_bits), name=f"{system.name}-kv{self.kv_bits}")
        if self.rest_bits is not None and system.rest_bits is not None:
            system = dataclasses.replace(system, rest_bits=int(self.rest_bits),
                                         name=f"{system.name}-rest{self.rest_bits}")
        if self.rest_key_bits is not None and system.rest_bits is not None:
            system = dataclasses.replace(system, rest_key_bits=int(self.rest_key_bits),
                                         name=f"{system.name}-restk{self.rest_key_bits}")
        system = system.schedule.apply(self, system)
        return self._apply(system)

    def _apply(self, system: System) -> System:
        """`system` with these options: SPEC's ablations (paper Fig. 18, named in the result), ITF's alpha,
        ContiguousKV's chunk, period and sub-period sizes (c, p, sp), CacheBlend's recompute ratio, deviation and
        filtering, speculation on every layer (`always_speculate`, named `NAME-always_speculate`), and spec_gqa's
        candidate stage (`gqa_candidates` x the kept tokens, named
        `spec_gqa-candidatesB`)."""
        if trait(system.identify, "periods"):
            return _with_chunk_sizes(system, self.ckv_chunk_tokens, self.period_layers, self.subperiod_layers)
        if trait(system.identify, "threshold") and self.alpha is not None:
            system = dataclasses.replace(system, alpha=float(self.alpha))
        if self.always_speculate and system.prefetch.speculative:
            system = dataclasses.replace(system, prefetch=dataclasses.replace(system.prefetch, always=True),
                                         name=f"{system.name}-always_speculate")
        if trait(system.identify, "candidate_stage") and self.gqa_candidates:
            system = dataclasses.replace(system, candidates=float(self.gqa_candidates),
                                         name=f"{system.name}-candidates{self.gqa_candidates:g}")
        if not trait(system.identify, "threshold"):
            return system
        on = [name for name in ABLATIONS if getattr(self, f"no_{name}")
              and (name != "prefetch" or system.prefetch.speculative)]  # no speculation: nothing to turn off
        if not on:
            return system
        return dataclasses.replace(system, name=system.name + "".join(f"-no_{name}" for name in on),
                                   **dict(ABLATIONS[name] for name in on))


def make_system(name: str, options: SystemOptions | None = None, **changes) -> System:
    """The registered system `name` with `options` (default: none), or with `changes`, SystemOptions fields by name
    (`make_system("spec", no_itf=True)`)."""
    if name not in SYSTEMS:
        raise SpecjaxError(f"unknown system {name!r}; known systems: {', '.join(system_names())}")
    return dataclasses.replace(options or SystemOptions(), **changes).apply(SYSTEMS[name])


def _with_chunk_sizes(system: System, chunk_tokens, period_layers, subperiod_layers) -> System:
    """ContiguousKV with other c / p / sp (None keeps the paper's 16 / 8 / 4); the name stays, results record them."""
    sizes = {"chunk_tokens": chunk_tokens, "period_layers": period_layers, "subperiod_layers": subperiod_layers}
    system = dataclasses.replace(system, **{k: int(v) for k, v in sizes.items() if v is not None})
    if system.subperiod_layers > system.period_layers:
        raise SpecjaxError(f"subperiod_layers ({system.subperiod_layers}) must not exceed period_layers "
                           f"({system.period_layers})")
    return system
