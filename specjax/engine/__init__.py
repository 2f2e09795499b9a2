"""The prefill engine over reused prefix KV, and the systems (policies) it runs."""

from specjax.engine.blend import BlendEngine
from specjax.engine.cake import CakeEngine
from specjax.engine.engine import Engine, fingerprint, shape_key
from specjax.engine.planner import PlannerEngine
from specjax.engine.policies import engine_for
from specjax.engine.state import ImportanceState
from specjax.engine.systems import SYSTEMS, System, SystemOptions, make_system, system_names
from specjax.engine.types import EngineConfig, Request, RequestResult


def make_engine(model, system: System, store=None, config: EngineConfig = EngineConfig(), *,
                selections=None) -> Engine:
    """The engine that runs `system`'s schedule (`specjax.engine.policies`): the layer loop, Cake's two-ended
    schedule, CacheBlend's chunk blending, the planner's layer loop with a computed head, or one a plugin binds;
    `selections`: the selection trace it records into or replays (`Engine`)."""
    return engine_for(system)(model, system, store, config, selections=selections)


__all__ = ["BlendEngine", "CakeEngine", "Engine", "EngineConfig", "ImportanceState", "PlannerEngine", "Request",
           "RequestResult", "SYSTEMS", "System", "SystemOptions", "fingerprint", "make_engine", "make_system",
           "shape_key", "system_names"]
