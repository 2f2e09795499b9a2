"""The prefill engine over reused prefix KV, and the systems (policies) it runs."""

from specjax.engine.blend import BlendEngine
from specjax.engine.cake import CakeEngine
from specjax.engine.engine import Engine, fingerprint, shape_key
from specjax.engine.planner import PlannerEngine
from specjax.engine.state import ImportanceState
from specjax.engine.systems import SYSTEMS, System, SystemOptions, make_system, system_names
from specjax.engine.types import EngineConfig, Request, RequestResult


def make_engine(model, system: System, store=None, config: EngineConfig = EngineConfig()) -> Engine:
    """The engine that runs `system`: the layer loop, Cake's two-ended schedule, CacheBlend's chunk blending, or the
    planner's layer loop with a computed head."""
    if system.schedule == "cake":
        return CakeEngine(model, system, store, config)
    if system.schedule == "planner":
        return PlannerEngine(model, system, store, config)
    if system.schedule == "blend":
        return BlendEngine(model, system, store, config)
    return Engine(model, system, store, config)


__all__ = ["BlendEngine", "CakeEngine", "Engine", "EngineConfig", "ImportanceState", "PlannerEngine", "Request",
           "RequestResult", "SYSTEMS", "System", "SystemOptions", "fingerprint", "make_engine", "make_system",
           "shape_key", "system_names"]
