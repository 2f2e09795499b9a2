"""The systems compared on the one engine, as policies: what a layer loads, what is prefetched, how caches score.

A system is data, not a copy of the engine; `make_system` applies SPEC's ablation switches.
"""

from __future__ import annotations

import dataclasses

from specjax.errors import SpecjaxError
from specjax.engine import identify
from specjax.stores.caches import POLICIES

# How a layer chooses its tokens (specjax.engine.identify): load all | per-head H2O | SPEC's ITF | ContiguousKV's chunks
IDENTIFY = tuple(identify.POLICIES)
# what is read for layer i+1 while layer i computes: nothing | its certain reads | those and a speculative guess of
# its selection | ContiguousKV's intra- and inter-period plan
PREFETCH = ("none", "certain", "speculative", "periods")
# the engine's layer loop | Cake's two-ended chunk schedule (specjax.engine.cake) | the layer loop computing a planned
# head of the stored prefix (specjax.engine.planner)
SCHEDULES = ("layers", "cake", "planner")
# CacheBlend's token selection: what deviation ranks tokens (recomputed vs reused vectors), and whether later layers
# keep filtering the set (the paper) or keep the check layer's set (the authors' reference code)
BLEND_DEVIATIONS = ("value", "key", "key_value")
BLEND_FILTERS = ("gradual", "fixed")


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    reuse: bool = True  # False: recompute the whole prefix, never touch the store
    identify: str = "none"
    prefetch: str = "none"  # what is read for layer i+1 while layer i computes
    cache_policy: str = "lru"  # stores.caches policy of the device and host tiers
    reorder: bool = False  # repack each radix node's chunks by importance between requests
    alpha: float = 0.6  # ITF threshold exponent, t = j ** alpha
    num_probe_heads: int = 3
    chunk_tokens: int | None = None  # the store chunk this system needs (None: the run's --chunk_tokens)
    period_layers: int = 8  # "chunks": layers sharing the chunk set chosen at the period's first layer
    subperiod_layers: int = 4  # "periods" prefetch: layers of a period loaded before the period computes
    schedule: str = "layers"
    # CacheBlend (specjax.engine.blend): the prefix is independently cached text chunks, all their KV is loaded
    # and this fraction of context tokens is recomputed per layer (0: full KV reuse); None: prefix reuse
    blend: float | None = None
    blend_deviation: str = "value"
    blend_filter: str = "gradual"
    # spec_gqa: only the chunks whose key summaries bound the most attention, at least this many times the kept
    # tokens, are scored and read (None: every position)
    candidates: float | None = None
    # spec_gqa on grouped-query models: a shared set must keep at least this share of every query head's own
    # top-k attention, else the layer falls back (None: SPEC's test alone)
    min_head_share: float | None = None
    description: str = ""  # one line, for --help and the reports

    def __post_init__(self):
        for field, value, known in (("identify", self.identify, IDENTIFY), ("prefetch", self.prefetch, PREFETCH),
                                    ("schedule", self.schedule, SCHEDULES),
                                    ("cache_policy", self.cache_policy, POLICIES),
                                    ("blend_deviation", self.blend_deviation, BLEND_DEVIATIONS),
                                    ("blend_filter", self.blend_filter, BLEND_FILTERS)):
            if value not in known:
                raise SpecjaxError(f"system {self.name!r}: unknown {field} {value!r}; choose one of "
                                   f"{', '.join(known)}")
        if self.candidates is not None and not self.candidates >= 1.0:
            raise SpecjaxError(f"system {self.name!r}: candidates must be at least 1 (x the kept tokens), got "
                               f"{self.candidates}")
        if self.min_head_share is not None and not 0.0 < self.min_head_share <= 1.0:
            raise SpecjaxError(f"system {self.name!r}: min_head_share must be in (0, 1], got {self.min_head_share}")
        if (self.prefetch == "periods") != (self.identify == "chunks"):
            raise SpecjaxError(f"system {self.name!r}: 'periods' prefetch goes with 'chunks' identification only")

    @property
    def prunes(self) -> bool:
        """It keeps a share of the stored prefix (`--retention`): accuracy and TTFT depend on the retention."""
        return self.identify != "none"


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System("recompute", reuse=False,
               description="full prefill of prefix + query (ReComp)"),
        System("as_full", identify="none", prefetch="certain", cache_policy="lru",
               description="AttentionStore-like: load all prefix KV, LRU caches"),
        System("as_h2o_lru", identify="h2o", prefetch="certain", cache_policy="lru",
               description="AS + H2O: all keys, important values, LRU"),
        System("as_h2o_lfu", identify="h2o", prefetch="certain", cache_policy="lfu",
               description="AS + H2O: all keys, important values, LFU"),
        System("impress", identify="itf", prefetch="certain", cache_policy="spec_score", reorder=True,
               description="IMPRESS: probe-head keys, important KV, score cache"),
        System("spec", identify="itf", prefetch="speculative", cache_policy="spec_score", reorder=True,
               description="SPEC: IMPRESS + layer-aware speculative prefetch"),
        # grouped-query-aware identification (issue 22): probes are KV heads, every query head keeps 90% of its
        # own top-k's attention under a shared set; candidates from key summaries of 16-token chunks (Quest's
        # pages; its own store) only when asked for (`candidates`)
        System("spec_gqa", identify="gqa_itf", prefetch="speculative", cache_policy="spec_score", reorder=True,
               min_head_share=0.9, chunk_tokens=16,
               description="SPEC with KV-head probes and a per-query-head guard (grouped-query models)"),
        System("contiguous_kv", identify="chunks", prefetch="periods", cache_policy="attention_score",
               chunk_tokens=16,
               description="ContiguousKV: 16-token chunks, periods, I x F cache"),
        System("cake", identify="none", cache_policy="lru", schedule="cake",
               description="Cake: compute from the front, load from the back"),
        # SPEC, computing per request the head of the stored prefix a cost model of measured rates says to (design
        # 5.2): head 0 is spec, the whole prefix recompute
        System("planner", identify="itf", prefetch="speculative", cache_policy="spec_score", reorder=True,
               schedule="planner",
               description="SPEC computing the head of the prefix a cost model of measured rates picks"),
        # CacheBlend and its lower bound: every chunk's KV, re-rotated to its place; prefetch the next layer's KV
        System("cacheblend", prefetch="certain", cache_policy="lru", blend=0.15,
               description="CacheBlend: reuse chunk KV, recompute deviating tokens (--blend_ratio)"),
        System("full_reuse", prefetch="certain", cache_policy="lru", blend=0.0,
               description="reuse all cached chunk KV, re-rotated, no recompute (CacheBlend's lower bound)"),
    )
}


def system_names() -> list[str]:
    return list(SYSTEMS)


def make_system(name: str, *, no_itf: bool = False, no_reorder: bool = False, no_score_cache: bool = False,
                no_prefetch: bool = False, alpha: float | None = None, chunk_tokens: int | None = None,
                period_layers: int | None = None, subperiod_layers: int | None = None,
                blend_ratio: float | None = None, blend_deviation: str | None = None,
                blend_filter: str | None = None, candidates: float | None = None) -> System:
    """The named system, with SPEC's ablations (paper Fig. 18) applied where they make sense, ContiguousKV's
    chunk, period and sub-period sizes (c, p, sp), CacheBlend's recompute ratio (`blend_ratio`), deviation
    and filtering (`blend_deviation`, `blend_filter`), and spec_gqa's candidate stage (`candidates` x the kept
    tokens, named `spec_gqa-candidatesB`; 0: none, every position a candidate, as by default)."""
    if name not in SYSTEMS:
        raise SpecjaxError(f"unknown system {name!r}; known systems: {', '.join(system_names())}")
    system = SYSTEMS[name]
    if system.blend:
        if blend_ratio is not None and not 0.0 <= blend_ratio <= 1.0:
            raise SpecjaxError(f"blend ratio must be in [0, 1], got {blend_ratio}")
        for value, known in ((blend_deviation, BLEND_DEVIATIONS), (blend_filter, BLEND_FILTERS)):
            if value is not None and value not in known:
                raise SpecjaxError(f"unknown cacheblend setting {value!r}; choose one of {', '.join(known)}")
        chosen = {"blend": blend_ratio, "blend_deviation": blend_deviation, "blend_filter": blend_filter}
        system = dataclasses.replace(system, **{k: v for k, v in chosen.items() if v is not None})
    changes = {}
    if system.identify == "itf":
        if no_itf:
            changes["identify"] = "h2o"
        if no_reorder:
            changes["reorder"] = False
        if no_score_cache:
            changes["cache_policy"] = "lfu"
        if no_prefetch and system.prefetch == "speculative":
            changes["prefetch"] = "certain"
        if alpha is not None:
            changes["alpha"] = alpha
    if system.identify == "chunks":
        return _with_chunk_sizes(system, chunk_tokens, period_layers, subperiod_layers)
    if system.identify == "gqa_itf" and candidates:
        return dataclasses.replace(system, candidates=float(candidates), name=f"{name}-candidates{candidates:g}")
    if changes:
        suffix = "".join(f"-no_{flag}" for flag, on in
                         (("itf", no_itf), ("reorder", no_reorder), ("score_cache", no_score_cache),
                          ("prefetch", no_prefetch)) if on)
        changes["name"] = name + suffix
        return dataclasses.replace(system, **changes)
    return system


def _with_chunk_sizes(system: System, chunk_tokens, period_layers, subperiod_layers) -> System:
    """ContiguousKV with other c / p / sp (None keeps the paper's 16 / 8 / 4); the name stays, results record them."""
    sizes = {"chunk_tokens": chunk_tokens, "period_layers": period_layers, "subperiod_layers": subperiod_layers}
    sizes = {k: int(v) for k, v in sizes.items() if v is not None}
    for field, value in sizes.items():
        if value < 1:
            raise SpecjaxError(f"{field} must be at least 1, got {value}")
    system = dataclasses.replace(system, **sizes)
    if system.subperiod_layers > system.period_layers:
        raise SpecjaxError(f"subperiod_layers ({system.subperiod_layers}) must not exceed period_layers "
                           f"({system.period_layers})")
    return system
