"""The prefill engine over reused prefix KV, and the systems (policies) it runs."""

from specjax.engine.blend import BlendEngine
from specjax.engine.engine import Engine, EngineConfig, Request, RequestResult, fingerprint
from specjax.engine.state import ImportanceState
from specjax.engine.systems import SYSTEMS, System, make_system, system_names

__all__ = ["BlendEngine", "Engine", "EngineConfig", "ImportanceState", "Request", "RequestResult", "SYSTEMS", "System",
           "fingerprint", "make_system", "system_names"]
