"""The planner (design 5.2): per request, how each part of the stored prefix KV is obtained. The device computes
the first `head` tokens of the stored prefix from scratch (Cake's direction) while the rest is loaded selectively
(SPEC's identification, speculation and caches); recompute (head = the whole prefix) and SPEC (head 0) are the two
extremes of one plan. The head is chosen from a cost model of measured rates, never typed-in ones:

    predicted TTFT(head) = C(head) + w x bytes(head) / disk rate

- C(head): the request's time with its waits for reads taken out (compute, identification, host work), measured
  per plan and stored prefix length: `calibrate` runs every candidate plan on the warm-up requests (its first run
  compiles the plan's programs and is not counted), and each later request of a plan updates it.
- bytes(head) = (stored tokens - head) x the disk bytes a loaded stored token costs, measured on this run's requests
  (what the caches hold, fallbacks and speculation's misses are in it).
- the disk rate: the read scheduler's, measured online (an emulated link's when throttled).
- w: the share of the reading time the request waits for (1: nothing overlaps it; 0: compute hides all of it),
  measured as waits / (bytes / rate) over the requests that read.

Recompute is predicted by its own measured time. Per request the plan, its prediction and every candidate's are in
`RequestResult.plan`; `CostModel.crossover_rate` is the disk rate above which loading is predicted to win.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from specjax.compiles import CompileCounter
from specjax.engine.cake import _layer_report
from specjax.engine.engine import Engine
from specjax.engine.types import EngineConfig, Request, RequestResult

# The heads a plan may compute, as fractions of the stored prefix (rounded down to whole store chunks); 1.0 is
# recompute. Few, so that calibration compiles and measures each once per prefix.
HEAD_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
_SMOOTHING = 0.3  # weight of a new measurement in a running estimate


def _update(old: float | None, new: float) -> float:
    return new if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * new


@dataclasses.dataclass
class CostModel:
    """The planner's measured rates. `compute_ms[(m, head)]`: a plan's time with its waits for reads taken out, for a
    stored prefix of m tokens (head == m: recompute's whole time); `bytes_per_token`: disk bytes per loaded stored
    token; `wait_share`: the share of the reading time (bytes / rate) a request waits for."""

    compute_ms: dict = dataclasses.field(default_factory=dict)
    bytes_per_token: float | None = None
    wait_share: float | None = None

    def candidates(self, m: int, chunk_tokens: int) -> list[int]:
        """The heads considered for a stored prefix of m tokens: whole store chunks, and m (recompute)."""
        heads = {min(m, int(f * m) // chunk_tokens * chunk_tokens) for f in HEAD_FRACTIONS[:-1]}
        return sorted(heads | {m})

    def observe(self, m: int, head: int, ttft_ms: float, wait_ms: float, disk_bytes: float,
                rate: float | None) -> None:
        """A request of plan `head` took `ttft_ms`, of which `wait_ms` waiting for reads, and read `disk_bytes`
        from a disk delivering `rate` bytes/s."""
        key = (m, head)
        self.compute_ms[key] = _update(self.compute_ms.get(key), max(0.0, ttft_ms - wait_ms))
        if head < m:
            self.bytes_per_token = _update(self.bytes_per_token, disk_bytes / (m - head))
            if disk_bytes and rate:
                self.wait_share = _update(self.wait_share, min(1.0, wait_ms / (disk_bytes / rate * 1e3)))

    def _compute(self, m: int, head: int) -> float | None:
        """C(head) for m stored tokens: measured for m, else scaled from the nearest m measured with the same share."""
        if (m, head) in self.compute_ms:
            return self.compute_ms[(m, head)]
        share = head / max(m, 1)
        near = [(abs(mm - m), mm, hh) for (mm, hh) in self.compute_ms if abs(hh / max(mm, 1) - share) < 0.13]
        if not near:
            return None
        _, mm, hh = min(near)
        return self.compute_ms[(mm, hh)] * m / max(mm, 1)

    def load_ms(self, m: int, head: int, rate: float | None) -> float | None:
        """The predicted wait for reads of plan `head` (ms)."""
        if head >= m:
            return 0.0
        if self.bytes_per_token is None or self.wait_share is None or not rate:
            return None
        return self.wait_share * self.bytes_per_token * (m - head) / rate * 1e3

    def predict(self, m: int, head: int, rate: float | None) -> float | None:
        """Predicted TTFT (ms) of plan `head` for m stored tokens at `rate` disk bytes/s; None if not yet measured."""
        compute, load = self._compute(m, head), self.load_ms(m, head, rate)
        return None if compute is None or load is None else compute + load

    def crossover_rate(self, m: int) -> float | None:
        """The disk rate (bytes/s) above which loading the stored prefix (head 0) is predicted to beat recomputing
        it; None where it is not measured or loading cannot win at any rate."""
        compute, recompute = self._compute(m, 0), self._compute(m, m)
        if None in (compute, recompute, self.bytes_per_token, self.wait_share) or compute >= recompute:
            return None
        return self.wait_share * self.bytes_per_token * m / ((recompute - compute) / 1e3)

    def summary(self, rate: float | None) -> dict:
        ms = sorted({m for m, _ in self.compute_ms})
        return {"disk_rate_bytes_per_s": rate, "bytes_per_loaded_token": self.bytes_per_token,
                "wait_share": self.wait_share,
                "compute_ms": {str(m): {str(h): c for (mm, h), c in sorted(self.compute_ms.items()) if mm == m}
                               for m in ms},
                "crossover_bytes_per_s": {str(m): self.crossover_rate(m) for m in ms}}


class PlannerEngine(Engine):
    """SPEC's engine that computes a planned head of each stored prefix instead of loading it (`Engine._run`'s
    `head`), the head chosen per request by the cost model."""

    def __init__(self, model, system, store, config: EngineConfig = EngineConfig()):
        super().__init__(model, system, store, config)
        self.costs = CostModel()
        self._forced: int | None = None  # calibration: the plan to run
        self._observing = True

    def calibrate(self, requests: list[Request], repeats: int = 2) -> None:
        """Run every candidate plan on each request once to compile its programs, then `repeats` times measuring
        C(head), the bytes a loaded token costs and the share of reading waited for; at warm-up, never in a timed
        request. The caches and speculation start empty afterwards, so the warm-up that follows is every system's."""
        try:
            for request in requests:
                with self.store.match([int(t) for t in request.prefix]) as match:
                    m = match.length
                for head in self.costs.candidates(m, self.store.layout.chunk_tokens) if m else []:
                    self._forced = head
                    for i in range(1 + repeats):
                        self._observing = i > 0
                        self.run(request)
        finally:
            self._forced, self._observing = None, True
        self.empty_caches()

    def rate(self) -> float | None:
        return self.store.scheduler.rate_bytes_per_s()

    def plan(self, m: int) -> tuple[int, dict]:
        """The head to compute for m stored tokens, and the prediction of every candidate (ms; None: unknown)."""
        rate = self.rate()
        predicted = {head: self.costs.predict(m, head, rate)
                     for head in self.costs.candidates(m, self.store.layout.chunk_tokens)}
        if self._forced is not None:
            return self._forced, predicted
        known = {head: t for head, t in predicted.items() if t is not None}
        if not known:  # nothing measured yet: SPEC's plan
            return 0, predicted
        return min(known, key=known.get), predicted

    def _run(self, request: Request, *, reuse: bool) -> RequestResult:
        if not reuse:
            return super()._run(request, reuse=False)
        with self.store.match([int(t) for t in request.prefix]) as match:
            m = match.length
        head, predicted = self.plan(m) if m else (0, {})
        if m and head >= m:
            result = super()._run(request, reuse=False)
            result.reused_tokens = m  # stored, and computed instead of loaded (as cake reports a computed share)
            result.layers = _layer_report(self.cfg.num_layers, m, m)
            result.split = {"stored_tokens": m, "computed_prefix_tokens": m, "loaded_prefix_tokens": 0}
        else:
            result = super()._run(request, reuse=True, head=head)
            result.split = result.split or {"stored_tokens": m, "computed_prefix_tokens": 0, "loaded_prefix_tokens": m}
        result.plan = {"stored_tokens": m, "head_tokens": head, "predicted_ttft_ms": predicted.get(head),
                       "candidates_ms": {str(h): t for h, t in predicted.items()},
                       "disk_rate_bytes_per_s": self.rate()}
        return result

    def run(self, request: Request) -> RequestResult:
        with CompileCounter() as compiles:
            result = super().run(request)
        plan = result.plan
        # a request that compiled a program measured the compiler, not the plan
        if self._observing and not compiles.count and plan is not None and plan["stored_tokens"] and not result.recomputed_bad_chunks:
            waits = result.breakdown_ms.get("kv_io_stall", 0.0) + result.breakdown_ms.get("probe_io", 0.0)
            self.costs.observe(plan["stored_tokens"], plan["head_tokens"], result.ttft_ms, waits,
                               result.io.get("disk_bytes", 0), self.rate())
        return result

    def model_summary(self) -> dict:
        return self.costs.summary(self.rate())


def prediction_errors(results: list[RequestResult]) -> np.ndarray:
    """|predicted - measured| / measured per request that had a prediction."""
    pairs = [(r.plan["predicted_ttft_ms"], r.ttft_ms) for r in results if r.plan and r.plan["predicted_ttft_ms"]]
    return np.asarray([abs(p - t) / t for p, t in pairs if t > 0 and math.isfinite(p)])


__all__ = ["CostModel", "PlannerEngine", "prediction_errors"]
