"""The typed policies a `System` is composed of besides its identification (`specjax.engine.identify`) and its
caches' scoring (`specjax.stores.caches.POLICIES`): what it prefetches (`Prefetch`) and the schedule that runs its
requests (`Schedule`: the engine's layer loop, Cake's, the planner's, CacheBlend's).

A schedule's engine is bound to its type by `runs(ScheduleType)` on the engine class (the public hook a new
schedule uses), and `engine_for(system)` finds it; nothing compares a system's name or a mode's string.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from specjax.connector import LOW_BITS
from specjax.errors import SpecjaxError


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """What is read for layer i+1 while layer i computes.

    `ahead`: every layer's certain reads (what its identification reads whatever it selects) are issued at the
    request's start, in layer order; without it a layer reads when it takes. `speculative`: besides, a guess of each
    next layer's selection (SPEC), after every layer if `always` (as the SPEC paper does), else only where a guess
    pays for its host time (`speculation.Speculator.pays`). `periods`: ContiguousKV's intra- and inter-period plan,
    issued as each period's first layer chooses its chunks (`identify="chunks"`)."""

    name: str
    ahead: bool = False
    speculative: bool = False
    always: bool = False
    periods: bool = False

    def __post_init__(self):
        if self.always and not self.speculative:
            raise SpecjaxError(f"prefetch {self.name!r}: `always` guesses, so it must be speculative")
        if self.periods and (self.ahead or self.speculative):
            raise SpecjaxError(f"prefetch {self.name!r}: a period plan issues every read of the request itself")


NO_PREFETCH = Prefetch("none")
CERTAIN = Prefetch("certain", ahead=True)
SPECULATIVE = Prefetch("speculative", ahead=True, speculative=True)
PERIODS = Prefetch("periods", periods=True)
# a `System`'s prefetch by name (`System(prefetch="certain")` is read as CERTAIN)
PREFETCHES = {p.name: p for p in (NO_PREFETCH, CERTAIN, SPECULATIVE, PERIODS)}


def prefetch(name_or_policy: str | Prefetch) -> Prefetch:
    if isinstance(name_or_policy, Prefetch):
        return name_or_policy
    if name_or_policy not in PREFETCHES:
        raise SpecjaxError(f"unknown prefetch {name_or_policy!r}; choose one of {', '.join(PREFETCHES)}")
    return PREFETCHES[name_or_policy]


# CacheBlend's token selection: what deviation ranks tokens (recomputed vs reused vectors), and whether later layers
# keep filtering the set (the paper) or keep the check layer's set (the authors' reference code)
BLEND_DEVIATIONS = ("value", "key", "key_value")
BLEND_FILTERS = ("gradual", "fixed")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How a request's prefill is scheduled: the engine's layer loop (`Layers`) unless a subclass says otherwise.

    `identifies_as`: the registered system whose selections this schedule's identification makes (a recorded
    selection trace of that system replays for it)."""

    name: ClassVar[str] = "layers"
    identifies_as: ClassVar[str | None] = None

    def check(self, config, chunk_tokens: int) -> None:
        """Refuse engine settings (`EngineConfig`) this schedule cannot run with a store of `chunk_tokens` chunks."""

    def apply(self, options, system):
        """`system` (which runs this schedule) with the `SystemOptions` that concern the schedule applied."""
        return system


@dataclasses.dataclass(frozen=True)
class Layers(Schedule):
    """The engine's layer loop (`specjax.engine.engine.Engine`)."""


@dataclasses.dataclass(frozen=True)
class Cake(Schedule):
    """Cake's two-ended chunk schedule: compute from the front, load from the back (`specjax.engine.cake`)."""

    name: ClassVar[str] = "cake"

    def check(self, config, chunk_tokens: int) -> None:
        cake = config.cake_chunk_tokens
        if cake <= 0 or cake % chunk_tokens:
            raise SpecjaxError(f"cake chunks of {cake} tokens must be a positive multiple of the store's "
                               f"{chunk_tokens}-token chunks: set --cake_chunk_tokens to a multiple of "
                               f"--chunk_tokens ({chunk_tokens})")


@dataclasses.dataclass(frozen=True)
class Planner(Schedule):
    """The layer loop computing the head of the stored prefix a cost model of measured rates picks per request
    (`specjax.engine.planner`). `bits`: the low precisions it may also load a whole stored prefix at, besides the
    system's `kv_bits` (the accuracy it may give up is the user's to bound: the fewest bits allowed)."""

    name: ClassVar[str] = "planner"
    identifies_as: ClassVar[str | None] = "spec"  # its loaded part identifies as SPEC
    bits: tuple[int, ...] = ()

    def apply(self, options, system):
        if options.plan_bits is None:
            return system
        bits = tuple(b for b in LOW_BITS if b >= options.plan_bits and b != system.kv_bits)
        return dataclasses.replace(system, schedule=dataclasses.replace(self, bits=bits),
                                   name=f"{system.name}-plan{options.plan_bits}")


@dataclasses.dataclass(frozen=True)
class Blend(Schedule):
    """CacheBlend's: the prefix is independently cached text chunks, all their KV is loaded and a share of context
    tokens recomputed per layer (`specjax.engine.blend`). `ratio`: the fraction of context tokens recomputed per layer
    (0: full KV reuse); `deviation` and `filter`: how tokens are ranked and whether later layers keep filtering."""

    name: ClassVar[str] = "blend"
    ratio: float = 0.15
    deviation: str = "value"
    filter: str = "gradual"

    def __post_init__(self):
        for field, value, known in (("blend_deviation", self.deviation, BLEND_DEVIATIONS),
                                    ("blend_filter", self.filter, BLEND_FILTERS)):
            if value not in known:
                raise SpecjaxError(f"unknown {field} {value!r}; choose one of {', '.join(known)}")
        if not 0.0 <= self.ratio <= 1.0:
            raise SpecjaxError(f"blend_ratio must be in [0, 1], got {self.ratio}")

    def apply(self, options, system):
        """full_reuse is CacheBlend at ratio 0 whatever the ratio asked for."""
        chosen = {"ratio": options.blend_ratio if self.ratio else None, "deviation": options.blend_deviation,
                  "filter": options.blend_filter}
        changed = dataclasses.replace(self, **{k: v for k, v in chosen.items() if v is not None})
        return dataclasses.replace(system, schedule=changed)


# schedule type -> the engine class that runs it (`runs`)
ENGINES: dict[type, type] = {}


def runs(schedule_type: type):
    """Class decorator binding an engine class to the schedule type it runs (`engine_for`)."""
    if not (isinstance(schedule_type, type) and issubclass(schedule_type, Schedule)):
        raise SpecjaxError(f"{schedule_type!r} is no Schedule type")

    def bind(cls):
        if schedule_type in ENGINES:
            raise SpecjaxError(f"schedule {schedule_type.__name__} is run by {ENGINES[schedule_type].__name__} "
                               f"already")
        ENGINES[schedule_type] = cls
        return cls

    return bind


def engine_for(system) -> type:
    """The engine class that runs `system`'s schedule."""
    cls = ENGINES.get(type(system.schedule))
    if cls is None:
        raise SpecjaxError(f"system {system.name!r}: no engine runs schedule {type(system.schedule).__name__} "
                           f"(bind one with specjax.engine.policies.runs)")
    return cls
