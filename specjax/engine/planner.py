"""The planner (docs/systems.md): per request, how each part of the stored prefix KV is obtained. The device computes
the first `head` tokens of the stored prefix from scratch (Cake's direction) while the rest is loaded selectively
(SPEC's identification, speculation and caches), or the whole prefix is loaded as it is (AttentionStore's way: at a
fast disk, or where the caches hold the prefix, identification can cost more than it saves); recompute (head = the
whole prefix) and SPEC (head 0) are the extremes of one plan. The plan is chosen per request from a cost model of
measured rates, never typed-in ones, and of what the caches hold for this prefix now:

    predicted TTFT(plan) = C(plan) + a x disk bytes(plan) / disk rate + b x loaded tokens(plan)

- C(plan): the request's time with its waits for reads taken out (compute, identification, host work), measured
  per plan and stored prefix length: `calibrate` runs every candidate plan on the warm-up requests (its first run
  compiles the plan's programs and is not counted), and each later request of a plan that compiled nothing updates it.
- disk bytes(plan) = p x the loaded tokens the cache tiers do not hold (looked up per layer and chunk at planning) +
  q x the loaded tokens, fitted per way of loading (selected or all) by least squares over its measured requests:
  loading everything reads exactly what the tiers lack (q = 0); SPEC's probe keys, fallbacks and the chunks its
  selection misses follow the tiers' share of the whole prefix only in part.
- the disk rate: the read scheduler's, measured online (an emulated link's when throttled).
- a, b: the waits for reads, fitted per way of loading by least squares over its measured requests (recent ones
  weigh more): a per second of the bytes' time at the disk's rate (below 1 where compute hides reading), b per loaded
  token whatever the bytes (per-read latency, host copies of cache hits, host work: on a page-cached disk most of it).

Recompute is predicted by its own measured time. Per request the plan, the share of its loaded tokens the caches
held, its prediction and every candidate's are in `RequestResult.plan`; `CostModel.crossover_rate` is the disk rate
above which loading a prefix the caches do not hold is predicted to win.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import numpy as np

from specjax import distributed
from specjax.compiles import CompileCounter
from specjax.connector import K, V
from specjax.engine.engine import Engine
from specjax.engine.identify import policy
from specjax.engine.policies import CERTAIN, Planner, runs
from specjax.engine.precision import Precision
from specjax.engine.types import EngineConfig, LayerRecord, Request, RequestResult

# The heads a plan may compute, as fractions of the stored prefix (rounded down to whole store chunks); 1.0 is
# recompute. Few, so that calibration compiles and measures each once per prefix.
HEAD_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
_SMOOTHING = 0.3  # weight of a new measurement in a running estimate
_FORGET = 0.9  # weight kept by the earlier requests of a fit at each new one (the last ~10 count most)


def _at(bits: int) -> str:
    """A label's precision suffix ("@4b"; none at the system's precision)."""
    return f"@{bits}b" if bits else ""


def _way_label(way: tuple[bool, int]) -> str:
    load_all, bits = way
    return ("all" if load_all else "selected") + _at(bits)


def _update(old: float | None, new: float) -> float:
    return new if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * new


@dataclasses.dataclass(frozen=True, order=True)
class Plan:
    """How a request obtains its stored prefix: the first `head` tokens computed (all of them: recompute), the rest
    selected and loaded (SPEC), or with `load_all` loaded whole (AttentionStore's way: no probe keys, no identification;
    head 0 only)."""
    head: int
    load_all: bool = False
    bits: int = 0  # the loaded K and V read at these low-bit rows of the store (0: at the system's precision)

    @property
    def label(self) -> str:
        return ("all" if self.load_all else str(self.head)) + _at(self.bits)

    @property
    def way(self) -> tuple[bool, int]:
        """How its loaded part is read: selected or all, at which precision. The cost model fits each way apart."""
        return self.load_all, self.bits


@dataclasses.dataclass
class LinearFit:
    """y = c0 x0 + c1 x1 with c0, c1 >= 0, least squares over the observations, each earlier one's weight multiplied
    by _FORGET at every new one. The planner fits a way of loading's waits for reads (x: the bytes' time at the disk's
    rate, ms; loaded tokens) and its disk bytes (x: loaded tokens the caches did not hold; loaded tokens)."""

    xx: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((2, 2)))
    xy: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(2))
    yy: float = 0.0
    _fitted: tuple | None = dataclasses.field(default=None, repr=False, compare=False)  # (coefficients,) until `add`

    def add(self, x0: float, x1: float, y: float) -> None:
        x = np.array([x0, x1], np.float64)
        self.xx = _FORGET * self.xx + np.outer(x, x)
        self.xy = _FORGET * self.xy + x * y
        self.yy = _FORGET * self.yy + y * y
        self._fitted = None

    def coefficients(self) -> tuple[float, float] | None:
        """(c0, c1): of the non-negative fits (c0 alone, c1 alone, both where the observations tell the terms apart),
        the one of least squared error, c0 alone where they tie (a single observation, or x0 in step with x1: waits are
        the bytes', bytes are the missing tokens', until the observations say otherwise); None before any."""
        if self._fitted is None:
            self._fitted = (self._fit(),)
        return self._fitted[0]

    def _fit(self) -> tuple[float, float] | None:
        if not self.xx.any():
            return None
        candidates = []
        for i in (0, 1):
            one = np.zeros(2)
            if self.xx[i, i] > 0:
                one[i] = max(0.0, self.xy[i] / self.xx[i, i])
            candidates.append(one)
        if np.linalg.cond(self.xx) < 1e8:
            both = np.linalg.solve(self.xx, self.xy)
            if (both >= 0).all():
                candidates.append(both)
        errors = [self.yy - 2 * c @ self.xy + c @ self.xx @ c for c in candidates]
        tie = 1e-9 * (self.yy + 1.0)
        best = next(c for c, e in zip(candidates, errors) if e <= min(errors) + tie)
        return float(best[0]), float(best[1])


@dataclasses.dataclass
class CostModel:
    """The planner's measured rates. `compute_ms[(m, plan)]`: a plan's time with its waits for reads taken out, for a
    stored prefix of m tokens (recompute: its whole time); per way of loading (`load_all`), fits of its disk bytes
    (`reads`: per loaded token the caches did not hold, and per loaded token whatever they held: SPEC's probe keys and
    the chunks its selection misses do not follow what the tiers hold of the whole prefix) and of its waits (`waits`)."""

    compute_ms: dict = dataclasses.field(default_factory=dict)
    reads: dict = dataclasses.field(default_factory=dict)
    waits: dict = dataclasses.field(default_factory=dict)

    def candidates(self, m: int, chunk_tokens: int, bits: tuple[int, ...] = ()) -> list[Plan]:
        """The plans considered for a stored prefix of m tokens: heads of whole store chunks with the rest selected,
        everything loaded, and recompute; and the whole prefix selected or loaded at each of `bits`."""
        heads = {min(m, int(f * m) // chunk_tokens * chunk_tokens) for f in HEAD_FRACTIONS[:-1]} - {m}
        low = [Plan(0, load_all, b) for b in bits for load_all in (False, True)]
        return sorted([Plan(h) for h in heads] + [Plan(0, load_all=True), Plan(m)] + low)

    def observe(self, m: int, plan: Plan, ttft_ms: float, wait_ms: float, disk_bytes: float,
                rate: float | None, held: float = 0.0) -> None:
        """A request of `plan` took `ttft_ms`, of which `wait_ms` waiting for reads, and read `disk_bytes` from a disk
        delivering `rate` bytes/s; the cache tiers held a share `held` of the tokens it loaded when it was planned."""
        key = (m, plan)
        self.compute_ms[key] = _update(self.compute_ms.get(key), max(0.0, ttft_ms - wait_ms))
        if plan.head >= m:
            return
        way, loaded = plan.way, m - plan.head
        self.reads.setdefault(way, LinearFit()).add(loaded * (1.0 - held), loaded, disk_bytes)
        if rate:
            self.waits.setdefault(way, LinearFit()).add(disk_bytes / rate * 1e3, loaded, wait_ms)

    def disk_bytes(self, m: int, plan: Plan, held: float = 0.0) -> float | None:
        """The predicted disk bytes of `plan` for m stored tokens when the caches hold a share `held` of what it
        loads."""
        if plan.head >= m:
            return 0.0
        fit = self.reads.get(plan.way)
        coefficients = fit.coefficients() if fit is not None else None
        if coefficients is None:
            return None
        loaded = m - plan.head
        return coefficients[0] * loaded * (1.0 - held) + coefficients[1] * loaded

    def _compute(self, m: int, plan: Plan) -> float | None:
        """C(plan) for m stored tokens: measured for m, else scaled from the nearest m measured for the same way of
        loading with the same computed share."""
        if (m, plan) in self.compute_ms:
            return self.compute_ms[(m, plan)]
        share = plan.head / max(m, 1)
        near = [(abs(mm - m), mm, p) for (mm, p) in self.compute_ms
                if p.way == plan.way and abs(p.head / max(mm, 1) - share) < 0.13]
        if not near:
            return None
        _, mm, p = min(near)
        return self.compute_ms[(mm, p)] * m / max(mm, 1)

    def load_ms(self, m: int, plan: Plan, rate: float | None, held: float = 0.0) -> float | None:
        """The predicted wait for reads of `plan` (ms) when the caches hold a share `held` of what it loads."""
        if plan.head >= m:
            return 0.0
        nbytes, fit = self.disk_bytes(m, plan, held), self.waits.get(plan.way)
        coefficients = fit.coefficients() if fit is not None else None
        if nbytes is None or coefficients is None or not rate:
            return None
        a, b = coefficients
        return a * nbytes / rate * 1e3 + b * (m - plan.head)

    def predict(self, m: int, plan: Plan, rate: float | None, held: float = 0.0) -> float | None:
        """Predicted TTFT (ms) of `plan` for m stored tokens at `rate` disk bytes/s, the caches holding a share `held`
        of what it loads; None if not yet measured."""
        compute, load = self._compute(m, plan), self.load_ms(m, plan, rate, held)
        return None if compute is None or load is None else compute + load

    def crossover_rate(self, m: int) -> float | None:
        """The disk rate (bytes/s) above which loading a stored prefix of m tokens that the caches do not hold (SPEC's
        plan, or everything if that wins at a lower rate) is predicted to beat recomputing it; 0.0 where loading wins
        whatever the rate, None where it is not measured or loading cannot win at any rate."""
        recompute, rates = self._compute(m, Plan(m)), []
        for plan in (Plan(0), Plan(0, load_all=True)):
            compute, fixed, bytes_at_1 = self._compute(m, plan), self.load_ms(m, plan, math.inf), None
            if None not in (compute, recompute, fixed):
                slack = recompute - compute - fixed  # what the bytes' time may take
                bytes_at_1 = self.load_ms(m, plan, 1.0) - fixed  # their wait at 1 byte/s
                if slack > 0:
                    rates.append(bytes_at_1 / slack if bytes_at_1 > 0 else 0.0)
        return min(rates) if rates else None

    def summary(self, rate: float | None) -> dict:
        ms = sorted({m for m, _ in self.compute_ms})
        waits = {way: fit.coefficients() for way, fit in self.waits.items()}
        reads = {way: fit.coefficients() for way, fit in self.reads.items()}
        return {"disk_rate_bytes_per_s": rate,
                "disk_bytes_per_missing_token": {_way_label(w): c[0] for w, c in reads.items() if c},
                "disk_bytes_per_loaded_token": {_way_label(w): c[1] for w, c in reads.items() if c},
                "wait_per_bytes_time": {_way_label(w): c[0] for w, c in waits.items() if c},
                "wait_ms_per_loaded_token": {_way_label(w): c[1] for w, c in waits.items() if c},
                "compute_ms": {str(m): {p.label: c for (mm, p), c in sorted(self.compute_ms.items()) if mm == m}
                               for m in ms},
                "crossover_bytes_per_s": {str(m): self.crossover_rate(m) for m in ms}}


@runs(Planner)
class PlannerEngine(Engine):
    """SPEC's engine that computes a planned head of each stored prefix instead of loading it (`Engine.attempt`'s
    `head`), or loads it whole, as the cost model says per request."""

    def __init__(self, model, system, store, config: EngineConfig = EngineConfig(), **kwargs):
        super().__init__(model, system, store, config, **kwargs)
        # what a plan's takes of K and V read, by its bits: the system's precision (0), or the plan's low-bit rows
        self._precisions = {0: self.precision, **{b: Precision(store.layout, b, model.dtype, self.facts.probe_is_k)
                                                  for b in system.plan_bits}}
        self.costs = CostModel()
        self._forced: Plan | None = None  # calibration: the plan to run
        self._observing = True

    def calibrate(self, requests: list[Request], repeats: int = 2) -> None:
        """Run every candidate plan on each request once to compile its programs, then `repeats` times measuring
        C(plan), the bytes a loaded token costs and the waits for reads; at warm-up, never in a timed
        request. It runs on caches and speculation of its own (`scratch_caches`): the engine's are left as they
        were, so the planner's requests find them warmed as every system's are."""
        try:
            with self.scratch_caches():
                for request in requests:
                    with self.store.match([int(t) for t in request.prefix]) as match:
                        m = match.length
                    for plan in self.candidates(m) if m else []:
                        self._forced = plan
                        for i in range(1 + repeats):
                            self._observing = i > 0
                            self.run(request)
        finally:
            self._forced, self._observing = None, True

    def rate(self) -> float | None:
        return self.store.scheduler.rate_bytes_per_s()

    def candidates(self, m: int) -> list[Plan]:
        """The plans for m stored tokens, at the system's precision and at each other the system may load at
        (`System.plan_bits`: the accuracy it may give up is the user's bound, docs/systems.md)."""
        return self.costs.candidates(m, self.store.layout.chunk_tokens, self.system.plan_bits)

    def precision_of(self, plan: Plan) -> Precision:
        """What `plan`'s takes of K and V read: the system's precision, or the plan's low-bit rows."""
        return self._precisions[plan.bits]

    def held_by_position(self, match, bits: int = 0) -> np.ndarray:
        """Per stored position of `match`, the share of its K and V over the layers (at `bits`, 0: the system's
        precision) that the cache tiers hold now (what a plan loading it would not read from disk)."""
        return self.held_by_precision(match)[bits]

    def held_by_precision(self, match) -> dict[int, np.ndarray]:
        """`held_by_position` at every precision a plan may read at, the stored positions' chunks located once:
        looked up per layer and chunk, the store's reordering included."""
        if not match.length:
            return {bits: np.zeros(0) for bits in self._precisions}
        chunks, inverse = np.unique(self.store.chunks_by_layer(match), return_inverse=True)
        layers = np.arange(self.cfg.num_layers)
        inverse = inverse.reshape(len(layers), match.length)
        out = {}
        for bits, precision in self._precisions.items():
            kinds = (precision.kind(K), precision.kind(V))  # as the plan would read them
            keys = [(int(layer), kind, int(c)) for layer in layers for kind in kinds for c in chunks]
            held = self.cache.held(keys).reshape(len(layers), 2, len(chunks))  # [layer, kind, chunk]
            out[bits] = held[layers[:, None], :, inverse].mean(axis=(0, 2))
        return out

    def plan(self, m: int, held: dict | None = None) -> tuple[Plan, dict, dict]:
        """The plan for m stored tokens, the prediction of every candidate (ms; None: unknown) and the share of each
        candidate's loaded tokens the caches hold (`held`: per precision a plan may read at, 0 the system's, the
        share per stored position, `held_by_precision`; None: nothing)."""
        rate = self.rate()
        shares = {plan: float(held[plan.bits][plan.head:].mean()) if held is not None and plan.head < m else 0.0
                  for plan in self.candidates(m)}
        predicted = {plan: self.costs.predict(m, plan, rate, share) for plan, share in shares.items()}
        if self._forced is not None:
            return self._forced, predicted, shares
        known = {plan: t for plan, t in predicted.items() if t is not None}
        if not known:  # nothing measured yet: SPEC's plan
            return Plan(0), predicted, shares
        return min(known, key=known.get), predicted, shares

    def attempt(self, request: Request, *, reuse: bool) -> RequestResult:
        if not reuse:
            return super().attempt(request, reuse=False)
        started, started_cpu = time.perf_counter(), time.process_time()
        with self.store.match([int(t) for t in request.prefix]) as match:
            m = match.length
            plan, predicted, shares = self.plan(m, self.held_by_precision(match)) if m else (Plan(0), {}, {})
            if self.processes:  # each process measured its own rates: every one runs process 0's plan
                head, load_all, bits = map(int, distributed.process_zeros(np.asarray(
                    [plan.head, plan.load_all, plan.bits], np.int64)))
                plan = Plan(head, bool(load_all), bits)
        planning_ms = (time.perf_counter() - started) * 1e3
        planning_cpu_ms = (time.process_time() - started_cpu) * 1e3
        if m and plan.head >= m:
            result = super().attempt(request, reuse=False)
            result.reused_tokens = m  # stored, and computed instead of loaded (as cake reports a computed share)
            result.layers = LayerRecord.split(self.cfg.num_layers, m, m)
        else:
            self.precision = self.precision_of(plan)
            try:
                if plan.load_all:
                    with self._loading_all():
                        result = super().attempt(request, reuse=True)
                else:
                    result = super().attempt(request, reuse=True, head=plan.head)
            finally:
                self.precision = self._precisions[0]
        # the request arrived before it was planned: planning is host work on its path to the first token
        result.ttft_ms += planning_ms
        result.breakdown_ms["compute"] = result.breakdown_ms.get("compute", 0.0) + planning_ms
        if result.host_exposed_ms is not None:
            result.host_exposed_ms += planning_ms
        if result.cpu_ms is not None:
            result.cpu_ms += planning_cpu_ms
        head = min(plan.head, m)
        result.split = {"stored_tokens": m, "computed_prefix_tokens": head, "loaded_prefix_tokens": m - head}
        result.plan = {"stored_tokens": m, "head_tokens": head, "load_all": plan.load_all, "bits": plan.bits,
                       "plan": plan.label,
                       "held_share": shares.get(plan, 0.0), "predicted_ttft_ms": predicted.get(plan),
                       "candidates_ms": {p.label: t for p, t in predicted.items()},
                       "disk_rate_bytes_per_s": self.rate()}
        return result

    @contextlib.contextmanager
    def _loading_all(self):
        """This request loads every stored token's K and V (the `none` identification, its certain reads planned at
        the start) through the same store, caches and scheduler; speculation sits it out."""
        saved = self.system, self.identification, self.speculator
        self.system = dataclasses.replace(self.system, identify="none", prefetch=CERTAIN)
        self.identification, self.speculator = policy("none"), None
        try:
            yield
        finally:
            self.system, self.identification, self.speculator = saved

    def run(self, request: Request) -> RequestResult:
        with CompileCounter() as compiles:
            result = super().run(request)
        plan = result.plan
        # a request that compiled a program measured the compiler, not the plan; one recomputed for a bad chunk
        # ran no plan
        measured = self._observing and not compiles.count and not result.recomputed_bad_chunks
        if measured and plan is not None and plan["stored_tokens"]:
            waits = result.breakdown_ms.get("kv_io_stall", 0.0) + result.breakdown_ms.get("probe_io", 0.0)
            ran = Plan(plan["head_tokens"], plan["load_all"], plan["bits"])
            self.costs.observe(plan["stored_tokens"], ran, result.ttft_ms, waits, result.io.get("disk_bytes", 0),
                               self.rate(), plan["held_share"])
        return result

    def model_summary(self) -> dict:
        return self.costs.summary(self.rate())


def prediction_errors(pairs) -> np.ndarray:
    """|predicted - measured| / measured for each (predicted, measured TTFT) pair that has a prediction."""
    return np.asarray([abs(p - t) / t for p, t in pairs if p and t > 0 and math.isfinite(p)])


__all__ = ["CostModel", "Plan", "PlannerEngine", "prediction_errors"]
