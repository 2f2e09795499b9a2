"""A system's typed policies (specjax.engine.policies): the engine bound to each schedule, prefetch by name, the
options each schedule takes, and a new schedule added through the public hook."""

import dataclasses

import numpy as np
import pytest

import specjax
from specjax.engine import BlendEngine, CakeEngine, Engine, EngineConfig, PlannerEngine, Request, make_engine
from specjax.engine import policies, systems
from specjax.engine.policies import CERTAIN, SPECULATIVE, Blend, Cake, Layers, Planner, Prefetch, Schedule, runs
from specjax.engine.systems import SYSTEMS, System, make_system
from specjax.errors import SpecjaxError


def test_every_registered_system_has_the_engine_of_its_schedule():
    expected = {Layers: Engine, Cake: CakeEngine, Planner: PlannerEngine, Blend: BlendEngine}
    for system in SYSTEMS.values():
        assert policies.engine_for(system) is expected[type(system.schedule)], system.name
    assert [s.name for s in SYSTEMS.values() if isinstance(s.schedule, Blend)] == ["cacheblend", "full_reuse"]


def test_prefetch_is_a_typed_policy_and_a_name_reads_as_the_registered_one():
    assert System("x", prefetch="certain").prefetch is CERTAIN
    assert SYSTEMS["spec"].prefetch is SPECULATIVE and SYSTEMS["spec"].prefetch.speculative
    assert not SYSTEMS["as_full"].prefetch.speculative and SYSTEMS["as_full"].prefetch.ahead
    assert SYSTEMS["contiguous_kv"].prefetch.periods and not SYSTEMS["recompute"].prefetch.ahead
    with pytest.raises(SpecjaxError, match="unknown prefetch 'eager'"):
        System("x", prefetch="eager")
    with pytest.raises(SpecjaxError, match="must be speculative"):
        Prefetch("odd", ahead=True, always=True)
    with pytest.raises(SpecjaxError, match="goes with 'chunks'"):
        System("x", identify="itf", prefetch="periods")
    with pytest.raises(SpecjaxError, match="must be a specjax.engine.policies.Schedule"):
        System("x", schedule="cake")


def test_options_reach_the_schedules_they_concern():
    assert make_system("cacheblend", blend_ratio=0.3, blend_filter="fixed").schedule == Blend(0.3, "value", "fixed")
    assert make_system("full_reuse", blend_ratio=0.3).schedule.ratio == 0.0  # CacheBlend's lower bound stays at 0
    planner = make_system("planner", plan_bits=4)
    assert (planner.name, planner.schedule.bits, planner.plan_bits) == ("planner-plan4", (8, 4), (8, 4))
    assert make_system("spec", plan_bits=4, blend_ratio=0.3) == make_system("spec")
    assert make_system("spec", always_speculate=True).prefetch == dataclasses.replace(SPECULATIVE, always=True)
    with pytest.raises(SpecjaxError, match="blend_ratio must be in"):
        Blend(ratio=1.5)
    with pytest.raises(SpecjaxError, match="positive multiple"):
        SYSTEMS["cake"].schedule.check(EngineConfig(cake_chunk_tokens=48), 32)
    Layers().check(EngineConfig(cake_chunk_tokens=48), 32)  # no other schedule reads cake's chunk


@dataclasses.dataclass(frozen=True)
class _Twice(Schedule):
    name = "twice"


def test_a_new_schedule_is_an_engine_bound_to_its_type():
    """A schedule of one's own: a `Schedule` type and an engine class bound to it; `make_engine` builds that engine
    for a system with the schedule, and it runs requests (here the layer loop's own `prefill`)."""
    model = specjax.load_model("tiny-llama", init="random", seed=1)
    request = Request([3, 5, 7, 9], [11, 13], [[2, 4]])
    try:
        @runs(_Twice)
        class TwiceEngine(Engine):
            pass

        system = System("twice", reuse=False, schedule=_Twice())
        engine = make_engine(model, system)
        assert type(engine) is TwiceEngine
        got = engine.run(request).first_token_logits
        with pytest.raises(SpecjaxError, match="run by TwiceEngine already"):
            runs(_Twice)(Engine)
    finally:
        policies.ENGINES.pop(_Twice, None)
    plain = make_engine(model, SYSTEMS["recompute"]).run(request).first_token_logits
    np.testing.assert_array_equal(got, plain)
    with pytest.raises(SpecjaxError, match="no engine runs schedule _Twice"):
        policies.engine_for(system)
    with pytest.raises(SpecjaxError, match="is no Schedule type"):
        runs(int)
    assert "twice" not in systems.SYSTEMS
