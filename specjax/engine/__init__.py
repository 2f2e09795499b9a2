"""The prefill engine over reused prefix KV, and the systems (policies) it runs."""

from specjax.engine.cake import CakeEngine, make_engine
from specjax.engine.engine import Engine, EngineConfig, Request, RequestResult, fingerprint
from specjax.engine.state import ImportanceState
from specjax.engine.systems import SYSTEMS, System, make_system, system_names

__all__ = ["CakeEngine", "Engine", "EngineConfig", "ImportanceState", "Request", "RequestResult", "SYSTEMS", "System",
           "fingerprint", "make_engine", "make_system", "system_names"]
