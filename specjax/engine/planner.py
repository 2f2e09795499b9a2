"""The planner (design 5.2): per request, how each part of the stored prefix KV is obtained. The device computes
the first `head` tokens of the stored prefix from scratch (Cake's direction) while the rest is loaded selectively
(SPEC's identification, speculation and caches), or the whole prefix is loaded as it is (AttentionStore's way: at a
fast disk identification can cost more than it saves); recompute (head = the whole prefix) and SPEC (head 0) are the
extremes of one plan. The plan is chosen from a cost model of measured rates, never typed-in ones:

    predicted TTFT(plan) = C(plan) + w x bytes(plan) / disk rate

- C(plan): the request's time with its waits for reads taken out (compute, identification, host work), measured
  per plan and stored prefix length: `calibrate` runs every candidate plan on the warm-up requests (its first run
  compiles the plan's programs and is not counted), and each later request of a plan that compiled nothing updates it.
- bytes(plan) = loaded stored tokens x the disk bytes a loaded token costs (selected, or all), measured on this run's
  requests (what the caches hold, fallbacks and speculation's misses are in it).
- the disk rate: the read scheduler's, measured online (an emulated link's when throttled).
- w: the time the request waits for reads over the bytes' time at that rate (below 1 where compute hides reading,
  above where per-read latency and host work add to it), measured per way of loading.

Recompute is predicted by its own measured time. Per request the plan, its prediction and every candidate's are in
`RequestResult.plan`; `CostModel.crossover_rate` is the disk rate above which loading is predicted to win.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np

from specjax.compiles import CompileCounter
from specjax.engine.cake import _layer_report
from specjax.engine.engine import Engine
from specjax.engine.identify import policy
from specjax.engine.types import EngineConfig, Request, RequestResult

# The heads a plan may compute, as fractions of the stored prefix (rounded down to whole store chunks); 1.0 is
# recompute. Few, so that calibration compiles and measures each once per prefix.
HEAD_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
_SMOOTHING = 0.3  # weight of a new measurement in a running estimate
_MAX_WAIT_SHARE = 10.0  # waits beyond the bytes' time (per-read latency, host work) are measured; this bounds noise


def _update(old: float | None, new: float) -> float:
    return new if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * new


@dataclasses.dataclass(frozen=True, order=True)
class Plan:
    """How a request obtains its stored prefix: the first `head` tokens computed (all of them: recompute), the rest
    selected and loaded (SPEC), or with `load_all` loaded whole (AttentionStore's way: no probe keys, no identification;
    head 0 only)."""
    head: int
    load_all: bool = False

    @property
    def label(self) -> str:
        return "all" if self.load_all else str(self.head)


@dataclasses.dataclass
class CostModel:
    """The planner's measured rates. `compute_ms[(m, plan)]`: a plan's time with its waits for reads taken out, for a
    stored prefix of m tokens (recompute: its whole time); per way of loading (`load_all`), `bytes_per_token`: disk
    bytes per loaded stored token, and `wait_share`: the time waited for reads over the bytes' time at the disk's
    rate (above 1 where latency and host work add to it)."""

    compute_ms: dict = dataclasses.field(default_factory=dict)
    bytes_per_token: dict = dataclasses.field(default_factory=dict)
    wait_share: dict = dataclasses.field(default_factory=dict)

    def candidates(self, m: int, chunk_tokens: int) -> list[Plan]:
        """The plans considered for a stored prefix of m tokens: heads of whole store chunks with the rest selected,
        everything loaded, and recompute."""
        heads = {min(m, int(f * m) // chunk_tokens * chunk_tokens) for f in HEAD_FRACTIONS[:-1]} - {m}
        return sorted([Plan(h) for h in heads] + [Plan(0, load_all=True), Plan(m)])

    def observe(self, m: int, plan: Plan, ttft_ms: float, wait_ms: float, disk_bytes: float,
                rate: float | None) -> None:
        """A request of `plan` took `ttft_ms`, of which `wait_ms` waiting for reads, and read `disk_bytes` from a disk
        delivering `rate` bytes/s."""
        key = (m, plan)
        self.compute_ms[key] = _update(self.compute_ms.get(key), max(0.0, ttft_ms - wait_ms))
        if plan.head < m:
            way = plan.load_all
            self.bytes_per_token[way] = _update(self.bytes_per_token.get(way), disk_bytes / (m - plan.head))
            if disk_bytes and rate:
                share = min(_MAX_WAIT_SHARE, wait_ms / (disk_bytes / rate * 1e3))
                self.wait_share[way] = _update(self.wait_share.get(way), share)

    def _compute(self, m: int, plan: Plan) -> float | None:
        """C(plan) for m stored tokens: measured for m, else scaled from the nearest m measured for the same way of
        loading with the same computed share."""
        if (m, plan) in self.compute_ms:
            return self.compute_ms[(m, plan)]
        share = plan.head / max(m, 1)
        near = [(abs(mm - m), mm, p) for (mm, p) in self.compute_ms
                if p.load_all == plan.load_all and abs(p.head / max(mm, 1) - share) < 0.13]
        if not near:
            return None
        _, mm, p = min(near)
        return self.compute_ms[(mm, p)] * m / max(mm, 1)

    def load_ms(self, m: int, plan: Plan, rate: float | None) -> float | None:
        """The predicted wait for reads of `plan` (ms)."""
        if plan.head >= m:
            return 0.0
        per_token, share = self.bytes_per_token.get(plan.load_all), self.wait_share.get(plan.load_all)
        if per_token is None or share is None or not rate:
            return None
        return share * per_token * (m - plan.head) / rate * 1e3

    def predict(self, m: int, plan: Plan, rate: float | None) -> float | None:
        """Predicted TTFT (ms) of `plan` for m stored tokens at `rate` disk bytes/s; None if not yet measured."""
        compute, load = self._compute(m, plan), self.load_ms(m, plan, rate)
        return None if compute is None or load is None else compute + load

    def crossover_rate(self, m: int) -> float | None:
        """The disk rate (bytes/s) above which loading the stored prefix (SPEC's plan, or everything if that computes
        less) is predicted to beat recomputing it; None where it is not measured or loading cannot win at any rate."""
        recompute, rates = self._compute(m, Plan(m)), []
        for plan in (Plan(0), Plan(0, load_all=True)):
            compute, load_at_1 = self._compute(m, plan), self.load_ms(m, plan, 1.0)  # load_ms at 1 byte/s
            if None not in (compute, recompute, load_at_1) and compute < recompute:
                rates.append(load_at_1 / (recompute - compute))
        return min(rates) if rates else None

    def summary(self, rate: float | None) -> dict:
        ms = sorted({m for m, _ in self.compute_ms})
        ways = {False: "selected", True: "all"}
        return {"disk_rate_bytes_per_s": rate,
                "bytes_per_loaded_token": {ways[w]: v for w, v in self.bytes_per_token.items()},
                "wait_share": {ways[w]: v for w, v in self.wait_share.items()},
                "compute_ms": {str(m): {p.label: c for (mm, p), c in sorted(self.compute_ms.items()) if mm == m}
                               for m in ms},
                "crossover_bytes_per_s": {str(m): self.crossover_rate(m) for m in ms}}


class PlannerEngine(Engine):
    """SPEC's engine that computes a planned head of each stored prefix instead of loading it (`Engine._run`'s
    `head`), or loads it whole, as the cost model says per request."""

    def __init__(self, model, system, store, config: EngineConfig = EngineConfig()):
        super().__init__(model, system, store, config)
        self.costs = CostModel()
        self._forced: Plan | None = None  # calibration: the plan to run
        self._observing = True

    def calibrate(self, requests: list[Request], repeats: int = 2) -> None:
        """Run every candidate plan on each request once to compile its programs, then `repeats` times measuring
        C(plan), the bytes a loaded token costs and the share of reading waited for; at warm-up, never in a timed
        request. The caches and speculation start empty afterwards, so the warm-up that follows is every system's."""
        try:
            for request in requests:
                with self.store.match([int(t) for t in request.prefix]) as match:
                    m = match.length
                for plan in self.costs.candidates(m, self.store.layout.chunk_tokens) if m else []:
                    self._forced = plan
                    for i in range(1 + repeats):
                        self._observing = i > 0
                        self.run(request)
        finally:
            self._forced, self._observing = None, True
        self.empty_caches()

    def rate(self) -> float | None:
        return self.store.scheduler.rate_bytes_per_s()

    def plan(self, m: int) -> tuple[Plan, dict]:
        """The plan for m stored tokens, and the prediction of every candidate (ms; None: unknown)."""
        rate = self.rate()
        predicted = {plan: self.costs.predict(m, plan, rate)
                     for plan in self.costs.candidates(m, self.store.layout.chunk_tokens)}
        if self._forced is not None:
            return self._forced, predicted
        known = {plan: t for plan, t in predicted.items() if t is not None}
        if not known:  # nothing measured yet: SPEC's plan
            return Plan(0), predicted
        return min(known, key=known.get), predicted

    def _run(self, request: Request, *, reuse: bool) -> RequestResult:
        if not reuse:
            return super()._run(request, reuse=False)
        with self.store.match([int(t) for t in request.prefix]) as match:
            m = match.length
        plan, predicted = self.plan(m) if m else (Plan(0), {})
        if m and plan.head >= m:
            result = super()._run(request, reuse=False)
            result.reused_tokens = m  # stored, and computed instead of loaded (as cake reports a computed share)
            result.layers = _layer_report(self.cfg.num_layers, m, m)
        elif plan.load_all:
            with self._loading_all():
                result = super()._run(request, reuse=True)
        else:
            result = super()._run(request, reuse=True, head=plan.head)
        head = min(plan.head, m)
        result.split = {"stored_tokens": m, "computed_prefix_tokens": head, "loaded_prefix_tokens": m - head}
        result.plan = {"stored_tokens": m, "head_tokens": head, "load_all": plan.load_all, "plan": plan.label,
                       "predicted_ttft_ms": predicted.get(plan),
                       "candidates_ms": {p.label: t for p, t in predicted.items()},
                       "disk_rate_bytes_per_s": self.rate()}
        return result

    @contextlib.contextmanager
    def _loading_all(self):
        """This request loads every stored token's K and V (the `none` identification, its certain reads planned at
        the start) through the same store, caches and scheduler; speculation sits it out."""
        saved = self.system, self.identification, self.speculator
        self.system = dataclasses.replace(self.system, identify="none", prefetch="certain")
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
            self.costs.observe(plan["stored_tokens"], Plan(plan["head_tokens"], plan["load_all"]), result.ttft_ms,
                               waits, result.io.get("disk_bytes", 0), self.rate())
        return result

    def model_summary(self) -> dict:
        return self.costs.summary(self.rate())


def prediction_errors(pairs) -> np.ndarray:
    """|predicted - measured| / measured for each (predicted, measured TTFT) pair that has a prediction."""
    return np.asarray([abs(p - t) / t for p, t in pairs if p and t > 0 and math.isfinite(p)])


__all__ = ["CostModel", "Plan", "PlannerEngine", "prediction_errors"]
