"""The planner (specjax.engine.planner) on random tiny OPT and Llama models: every plan is exact at retention 1.0,
a computed head is not read, and the cost model picks the plan its measured rates say is fastest."""

import math
import time

import numpy as np
import pytest
import tensorstore as ts

import specjax
from specjax.engine import Engine, EngineConfig, Request, fingerprint, make_engine, make_system
from specjax.engine.planner import CostModel, Plan, PlannerEngine, LinearFit, prediction_errors
from specjax.stores import K, V, KVStore
from specjax.stores.kvarray import K_RANGE, low_bit

EXACT = 1e-5  # fp32, against the engine's recompute
STORE_CHUNK = 16


@pytest.fixture(scope="module", params=["tiny-opt", "tiny-llama"])
def model(request):
    return specjax.load_model(request.param, init="random", seed=1)


def _store(model, kv_bits=()):
    spec = {"driver": "memory", "path": f"kv{np.random.randint(1 << 30)}/"}
    return KVStore.open(spec, fingerprint(model, STORE_CHUNK, kv_bits), context=ts.Context())


def _request(model, prefix_len=100, query_len=7, seed=0):
    rng = np.random.default_rng(seed)
    v = model.config.vocab_size
    return Request(rng.integers(0, v, prefix_len).tolist(), rng.integers(0, v, query_len).tolist(),
                   [rng.integers(0, v, 3).tolist(), rng.integers(0, v, 6).tolist()])


def _planner(model, **config) -> PlannerEngine:
    engine = make_engine(model, make_system("planner"), _store(model), EngineConfig(**config))
    assert isinstance(engine, PlannerEngine)
    return engine


def _forced(engine, request, head, load_all=False, bits=0):
    engine._forced = Plan(head, load_all, bits)
    try:
        return engine.run(request)
    finally:
        engine._forced = None


def test_every_plan_equals_recompute_at_full_retention(model):
    req = _request(model)  # 100 stored tokens: heads 0, 16, 48, 64 (whole store chunks) and 100 (recompute)
    engine = _planner(model, retention=1.0)
    engine.warm(req.prefix)
    base = Engine(model, make_system("recompute"), None).run(req)
    plans = engine.costs.candidates(100, STORE_CHUNK)
    assert plans == [Plan(0), Plan(0, load_all=True), Plan(16), Plan(48), Plan(64), Plan(100)]
    for plan in plans:
        head = plan.head
        r = _forced(engine, req, head, plan.load_all)
        np.testing.assert_allclose(r.first_token_logits, base.first_token_logits, atol=EXACT, rtol=0)
        np.testing.assert_allclose([c for c, _ in r.continuation_logprobs],
                                   [c for c, _ in base.continuation_logprobs], atol=EXACT, rtol=0)
        assert r.plan["head_tokens"] == head and r.plan["stored_tokens"] == 100 and r.plan["plan"] == plan.label
        assert r.split["computed_prefix_tokens"] == head and r.split["loaded_prefix_tokens"] == 100 - head
        assert r.computed_tokens == len(req.query) + (head if head < 100 else 100)


def test_a_computed_head_is_not_read(model):
    req = _request(model, prefix_len=128)
    engine = _planner(model, retention=0.25)
    engine.warm(req.prefix)
    reads = {head: _forced(engine, req, head).io["disk_bytes"] for head in (0, 64, 128)}
    assert reads[128] == 0  # recompute
    assert 0 < reads[64] < reads[0]
    everything = _forced(engine, req, 0, load_all=True)  # K and V of every stored token, no probe keys
    cfg = model.config
    assert everything.io["disk_bytes"] == everything.io["used_token_bytes"] == 2 * cfg.num_layers * 128 * \
        cfg.num_kv_heads * cfg.head_dim * 4
    assert everything.io["probe_disk_bytes"] == 0 and everything.layers["retained"] == [1.0] * model.config.num_layers
    # at retention 1.0 the loaded tokens' K/V are read whole: the head's share of them is not
    full = _planner(model, retention=1.0)
    full.warm(req.prefix)
    loaded = {head: _forced(full, req, head).io["disk_bytes"] for head in (0, 64)}
    assert loaded[64] == pytest.approx(loaded[0] / 2, rel=0.05)


def test_calibration_measures_every_plan_and_the_plan_follows_the_rates(model):
    req = _request(model, prefix_len=128)
    engine = _planner(model)
    engine.warm(req.prefix)
    engine.calibrate([req])
    plans = engine.costs.candidates(128, STORE_CHUNK)
    assert set(engine.costs.compute_ms) == {(128, p) for p in plans}
    reads = engine.costs.reads
    assert sum(reads[(False, 0)].coefficients()) > 0 and reads[(True, 0)].coefficients()[0] > 0
    r = engine.run(req)
    assert r.plan["predicted_ttft_ms"] is not None
    assert set(r.plan["candidates_ms"]) == {p.label for p in plans}
    assert r.plan["plan"] == min(plans, key=lambda p: r.plan["candidates_ms"][p.label]).label
    assert len(prediction_errors([(r.plan["predicted_ttft_ms"], r.ttft_ms)])) == 1
    # a disk too slow to load anything: recompute; an instant one: the plan whose compute plus per-token read cost
    # (what no disk rate removes) is least; in between, a faster disk never makes the plan load fewer bytes (its wait
    # at 1 byte/s never falls as the rate rises)
    # (a 128-token tiny model's measured plans differ little, and a page-cached disk's waits barely follow the
    # bytes' time, so the engine plans here from a model of known rates: computing the stored prefix costs 100 ms,
    # loading it 1 ms, its waits are its bytes' time plus 0.01 ms a loaded token, 1,000 bytes a token, twice that
    # when it loads everything)
    engine.costs = CostModel()
    for p in plans:
        loaded, per_token = 128 - p.head, 2000 if p.load_all else 1000
        wait = loaded * per_token / 10e6 * 1e3 + 0.01 * loaded
        engine.costs.observe(128, p, 1.0 + 99.0 * p.head / 128 + wait, wait, loaded * per_token, 10e6)
    engine.rate = lambda: 1.0
    assert engine.plan(128)[0] == Plan(128)
    engine.rate = lambda: math.inf
    fixed = {p: engine.costs.compute_ms[(128, p)] + engine.costs.load_ms(128, p, math.inf) for p in plans}
    assert engine.plan(128)[0] == min(plans, key=fixed.get)
    bytes_wait = []  # the chosen plan's wait at 1 byte/s beyond its per-token part
    for rate in 10.0 ** np.arange(0, 16):
        engine.rate = lambda rate=rate: rate
        chosen = engine.plan(128)[0]
        bytes_wait.append(engine.costs.load_ms(128, chosen, 1.0) - engine.costs.load_ms(128, chosen, math.inf))
    assert bytes_wait[0] == 0.0 < bytes_wait[-1] and bytes_wait == sorted(bytes_wait)


def test_calibration_leaves_the_caches_and_speculation_the_timed_requests_find(model):
    """The calibration's many runs go to caches of their own: the engine's hold what they held, with the same
    statistics, and the store no longer keeps the calibration's caches (nor tells them of freed chunks)."""
    req = _request(model, prefix_len=128)
    engine = _planner(model, gpu_cache_bytes=1 << 14, cpu_cache_bytes=1 << 16)  # holds a part of the prefix
    engine.warm(req.prefix)
    engine.run(req)
    cache, speculator, callbacks = engine.cache, engine.speculator, engine.store.index.free_callbacks()
    held = {name: set(tier.items) for name, tier in cache.tiers.items()}
    stats = {key: (s.freq, s.important_fraction) for key, s in cache.stats.items()}
    assert held["device"] or held["host"]
    engine.calibrate([req])
    assert engine.cache is cache and engine.speculator is speculator
    assert {name: set(tier.items) for name, tier in cache.tiers.items()} == held
    assert {key: (s.freq, s.important_fraction) for key, s in cache.stats.items()} == stats
    assert engine.store.index.free_callbacks() == callbacks
    engine.empty_caches()  # a new start lets the old caches go as well
    assert engine.cache is not cache and len(engine.store.index.free_callbacks()) == len(callbacks)
    assert cache.invalidate not in engine.store.index.free_callbacks()


def test_cost_model_prediction_and_crossover():
    costs = CostModel()
    # SPEC's plan: 10 ms of compute, 1,000 disk bytes per loaded token the caches do not hold, waits for half the
    # bytes' time plus 0.01 ms per loaded token (1 MB at 10 MB/s: 100 ms, 50 + 10 waited; half of it held: 25 + 10);
    # everything loaded: 5 ms, 4,000 bytes per token, waits twice the bytes' time (latency); half computed: 30 ms;
    # recompute: 50 ms
    costs.observe(1000, Plan(0), ttft_ms=70.0, wait_ms=60.0, disk_bytes=1_000_000, rate=10e6)
    costs.observe(1000, Plan(0), ttft_ms=45.0, wait_ms=35.0, disk_bytes=500_000, rate=10e6, held=0.5)
    costs.observe(1000, Plan(0, load_all=True), ttft_ms=805.0, wait_ms=800.0, disk_bytes=4_000_000, rate=10e6)
    costs.observe(1000, Plan(0, load_all=True), ttft_ms=205.0, wait_ms=200.0, disk_bytes=1_000_000, rate=10e6,
                  held=0.75)
    costs.observe(1000, Plan(500), ttft_ms=60.0, wait_ms=30.0, disk_bytes=500_000, rate=10e6)
    costs.observe(1000, Plan(1000), ttft_ms=50.0, wait_ms=0.0, disk_bytes=0, rate=10e6)
    assert costs.compute_ms == {(1000, Plan(0)): 10.0, (1000, Plan(0, True)): 5.0, (1000, Plan(500)): 30.0,
                                (1000, Plan(1000)): 50.0}
    assert costs.waits[(False, 0)].coefficients() == pytest.approx((0.5, 0.01))
    assert costs.waits[(True, 0)].coefficients() == pytest.approx((2.0, 0.0), abs=1e-9)
    assert costs.reads[(False, 0)].coefficients() == pytest.approx((1000.0, 0.0), abs=1e-6)
    assert costs.reads[(True, 0)].coefficients() == pytest.approx((4000.0, 0.0), abs=1e-6)
    assert costs.predict(1000, Plan(0), 10e6) == pytest.approx(10.0 + 50.0 + 10.0)
    assert costs.predict(1000, Plan(0), 10e6, held=0.5) == pytest.approx(10.0 + 25.0 + 10.0)
    assert costs.predict(1000, Plan(500), 10e6) == pytest.approx(30.0 + 25.0 + 5.0)
    assert costs.predict(1000, Plan(0, load_all=True), 10e6) == pytest.approx(5.0 + 800.0)
    # a prefix the caches hold whole: loading everything reads nothing and identifies nothing
    assert costs.predict(1000, Plan(0, load_all=True), 10e6, held=1.0) == pytest.approx(5.0)
    assert costs.predict(1000, Plan(1000), 10e6) == pytest.approx(50.0)
    assert costs.predict(1000, Plan(0), None) is None and costs.predict(1000, Plan(250), 10e6) is None
    # SPEC's plan equals recompute's 50 ms where its bytes' wait is 50 - 10 - 10 = 30 ms: 0.5 x 1e6 bytes / 30 ms,
    # 16.7 MB/s (loading everything would need 2 x 4e6 bytes / 45 ms: 178 MB/s)
    rate = costs.crossover_rate(1000)
    assert rate == pytest.approx(0.5e6 / 0.030)
    assert costs.predict(1000, Plan(0), rate) == pytest.approx(50.0)
    # another prefix length with the same shares: C scaled from the measured one (60 ms), the per-token waits of
    # its 1,000 loaded tokens (10 ms) at a disk too fast for the bytes to count
    assert costs.predict(2000, Plan(1000), 1e15) == pytest.approx(70.0, rel=1e-6)
    # loading that computes longer than recomputing never wins
    slow = CostModel()
    slow.observe(100, Plan(0), 80.0, 0.0, 1000, 1e6)
    slow.observe(100, Plan(100), 50.0, 0.0, 0, 1e6)
    assert slow.crossover_rate(100) is None
    # waits that do not grow with the bytes (a page-cached disk): loading wins whatever the rate
    flat = CostModel()
    flat.observe(100, Plan(0), 30.0, 20.0, 1000, 1e6)
    flat.observe(100, Plan(0), 30.0, 20.0, 500, 1e6, held=0.5)
    flat.observe(100, Plan(100), 50.0, 0.0, 0, 1e6)
    assert flat.waits[(False, 0)].coefficients() == pytest.approx((0.0, 0.2))
    assert flat.crossover_rate(100) == pytest.approx(0.0, abs=1.0)  # bytes/s


def test_the_fits_keep_their_terms_non_negative_and_follow_recent_requests():
    # SPEC's reads that do not follow what the tiers hold of the whole prefix (probe keys, the chunks its selection
    # misses): the per-loaded-token term alone
    reads = LinearFit()
    for held in (0.0, 0.5, 0.9):
        reads.add(1000 * (1 - held), 1000, 8e6)
    assert reads.coefficients() == pytest.approx((0.0, 8000.0))
    fit = LinearFit()
    assert fit.coefficients() is None
    # waits that fall as the bytes grow: no negative rate, the per-token term alone
    for bytes_ms, wait in ((10.0, 50.0), (100.0, 40.0), (200.0, 30.0)):
        fit.add(bytes_ms, 100.0, wait)
    a, b = fit.coefficients()
    assert a == 0.0 and b == pytest.approx(0.4, rel=0.05)
    # the disk slows down: recent requests dominate
    for _ in range(60):
        fit.add(100.0, 100.0, 200.0)
        fit.add(50.0, 100.0, 100.0)
    assert fit.coefficients() == pytest.approx((2.0, 0.0), abs=1e-3)


def test_the_plan_follows_what_the_caches_hold_and_planning_counts_in_the_ttft(model, monkeypatch):
    """Loading everything is chosen for a prefix the tiers hold, SPEC's plan for one on disk; the time spent planning
    is on the request's path to its first token."""
    req = _request(model, prefix_len=128)
    engine = _planner(model, gpu_cache_bytes=1 << 30, cpu_cache_bytes=1 << 30)
    engine.warm(req.prefix)
    with engine.store.match(req.prefix) as match:
        assert engine.held_by_position(match).tolist() == [0.0] * 128
    _forced(engine, req, 0, load_all=True)  # placed in the tiers when the request ends
    with engine.store.match(req.prefix) as match:
        assert engine.held_by_position(match).tolist() == [1.0] * 128
    engine.costs.observe(128, Plan(0), 30.0, 20.0, 20_000, 1e6)  # selected: 10 ms + 20 ms reading
    engine.costs.observe(128, Plan(0, load_all=True), 60.0, 55.0, 50_000, 1e6)  # all: 5 ms + 55 ms reading
    engine.costs.observe(128, Plan(128), 100.0, 0.0, 0, 1e6)
    engine.rate = lambda: 1e6
    held = {0: np.ones(128)}
    assert engine.plan(128, held)[0] == Plan(0, load_all=True)
    assert engine.plan(128, {0: np.zeros(128)})[0] == Plan(0)
    assert engine.plan(128, held)[2][Plan(0, load_all=True)] == 1.0

    def slow_lookup(match):
        time.sleep(0.2)
        return held
    monkeypatch.setattr(engine, "held_by_precision", slow_lookup)
    r = engine.run(req)
    assert r.plan["plan"] == "all" and r.plan["held_share"] == 1.0
    assert r.ttft_ms >= 200.0 and r.breakdown_ms["compute"] >= 200.0
    assert sum(r.breakdown_ms.values()) == pytest.approx(r.ttft_ms)


def test_only_a_plan_that_identified_the_whole_stored_prefix_records_its_importance(model):
    """Loading everything or computing a head measures nothing of the stored tokens' importance: recording it (all
    ones, or none for the head) would skew SPEC's reordering (measured: a calibration that recorded its load-all runs
    left the planner reading 1.7x spec's bytes)."""
    req = _request(model, prefix_len=128)
    engine = _planner(model)
    engine.warm(req.prefix)

    def observations():
        return sum(int(seg.imp_count.sum()) for seg in engine.store.segments())

    for head, load_all in ((0, True), (64, False)):
        _forced(engine, req, head, load_all)
        assert observations() == 0
    _forced(engine, req, 0)
    assert observations() == 128


def test_the_planner_measures_its_plans_on_the_store_the_timed_requests_find():
    """The eval's warm-up: the planner calibrates after the store's repack (before it SPEC's plan reads far more), then
    makes the second pass as every system does (the calibration on caches of its own)."""
    from specjax.eval.engine_systems import warm_up

    class Recorder:
        def __init__(self, planner):
            self.calls, self.system = [], type("S", (), {"reorder": True})()
            if planner:
                self.calibrate = lambda requests: self.calls.append(("calibrate", len(requests)))

        def run(self, request):
            self.calls.append(("run", request))

        def reorder(self):
            self.calls.append(("reorder",))

    spec, planner = Recorder(planner=False), Recorder(planner=True)
    warm_up(spec, ["a", "b"])
    warm_up(planner, ["a", "b"])
    runs = [("run", "a"), ("run", "b")]
    assert spec.calls == runs + [("reorder",)] + runs
    assert planner.calls == runs + [("reorder",), ("calibrate", 2)] + runs


def test_the_planner_weighs_loading_at_fewer_bits(model):
    """planner-plan4 also plans the whole stored prefix selected or loaded at 8 and 4 bits: such a plan reads only
    those rows and answers as the system loading at them does (as_full-kv4), the calibration measures it, and the
    cost model picks it where its fewer bytes make it fastest."""
    system = make_system("planner", plan_bits=4)
    assert system.name == "planner-plan4" and system.plan_bits == (8, 4) and system.store_bits == (8, 4)
    req = _request(model, prefix_len=128)
    engine = make_engine(model, system, _store(model, system.store_bits), EngineConfig(retention=0.25))
    engine.warm(req.prefix)
    plans = engine.candidates(128)
    assert {Plan(0, False, 4), Plan(0, True, 4), Plan(0, False, 8), Plan(0, True, 8)} <= set(plans)
    low = _forced(engine, req, 0, load_all=True, bits=4)
    full = _forced(engine, req, 0, load_all=True)
    assert low.plan["plan"] == "all@4b" and low.plan["bits"] == 4
    cfg = model.config
    lay = engine.store.layout
    # K's codes and its chunk's range share, V's codes and its groups' scales and zero points
    token = sum(lay.token_nbytes(kind) for kind in (low_bit(K, 4), K_RANGE, low_bit(V, 4)))
    d = cfg.head_dim
    assert token == cfg.num_kv_heads * (d // 2 + -(-4 * d // lay.chunk_tokens) + d // 2 + 4 * (d // lay.group_channels))
    assert low.io["disk_bytes"] == cfg.num_layers * 128 * token
    assert full.io["disk_bytes"] == cfg.num_layers * 128 * cfg.num_kv_heads * 2 * cfg.head_dim * 4
    reference = make_engine(model, make_system("as_full", kv_bits=4), _store(model, (4,)), EngineConfig())
    reference.warm(req.prefix)
    want = reference.run(req)
    np.testing.assert_allclose(low.first_token_logits, want.first_token_logits, atol=EXACT, rtol=0)
    assert engine.precision is engine.precision_of(Plan(0))  # the system's again after the request
    engine.calibrate([req])
    assert set(engine.costs.compute_ms) == {(128, p) for p in plans}
    assert engine.costs.reads[(True, 4)].coefficients()[0] < engine.costs.reads[(True, 0)].coefficients()[0]
    # a disk slow enough for the bytes to decide, with loading everything cheaper than identifying: the fewest bytes
    engine.costs = CostModel()
    for p in plans:
        loaded = 128 - p.head
        per_token = {0: 1000, 8: 560, 4: 310}[p.bits] * (2 if p.load_all else 1)
        wait = loaded * per_token / 10e6 * 1e3
        engine.costs.observe(128, p, 1000.0 * p.head / 128 + wait + (1.0 if p.load_all else 50.0), wait,
                             loaded * per_token, 10e6)
    engine.rate = lambda: 1e5
    assert engine.plan(128)[0] == Plan(0, False, 4)
    engine.rate = lambda: 1e12  # the bytes cost nothing: loading everything, at whichever bits (they tie)
    assert engine.plan(128)[0].load_all


def test_results_count_the_planners_requests_per_precision():
    """results.json's planner section counts the requests each precision was planned at (0: the system's)."""
    import types

    from specjax.eval.report import _planner as planner_section

    outs = [types.SimpleNamespace(ttft_ms=10.0, counters={"planned_bits": b, "reused_tokens": 64,
                                                           "planned_load_all": float(b > 0)}) for b in (0, 4, 4, 8)]
    section = planner_section(outs, None)
    assert section["bits_counts"] == {"0": 1, "4": 2, "8": 1} and section["load_all_requests"] == 3
