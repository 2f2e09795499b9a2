"""A new system in one file: StreamingLLM's window (attention sinks and the most recent tokens) as a selection policy.

Each layer keeps, for every head, the first `SINKS` tokens of the reused prefix and the most recent ones, as many as
the retention allows (StreamingLLM, Xiao et al. 2024), and reads only those tokens' K and V. It needs no scores, so
it reads nothing else. Importing this file registers the policy as the identification "recent" and the system
"recent_window" that uses it; then every tool names it like the engine's own systems:

    python -m specjax.eval --plugins examples/recent_window.py --systems as_full,recent_window --retention 0.25

    import specjax, runpy
    runpy.run_path("examples/recent_window.py")
    engine = specjax.prefill_engine(model, "recent_window", store, retention=0.25)

docs/development.md ("Adding a system") walks through it.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from specjax.engine import identify, state, systems
from specjax.engine.policy_steps import Selected, Take
from specjax.kernels import SharedIndices
from specjax.shapes import padded
from specjax.stores import K, V

SINKS = 4  # the first tokens every head keeps (StreamingLLM's attention sinks)


def window(m: int, k: int, sinks: int = SINKS) -> np.ndarray:
    """The positions of an m-token prefix a k-token window keeps: the first `sinks`, then the last k - sinks."""
    k = min(k, m)
    first = min(sinks, k)
    return np.concatenate([np.arange(first), np.arange(m - (k - first), m)]).astype(np.int64)


@identify.register("recent")
class RecentWindow:
    """Attention sinks and the most recent tokens, the same set for every head; only their K and V are read."""

    def certain_reads(self, facts) -> tuple:
        return ()  # nothing is read for every position

    def selection_reads(self, facts) -> tuple:
        return (K, V)  # the chosen tokens' keys and values

    def select(self, facts, layer, importance_state):
        chosen = window(layer.m, layer.k)
        keys = yield Take(K, chosen, layer.k_cap)
        values = yield Take(V, chosen, layer.k_cap)
        rows = jnp.asarray(padded(chosen, layer.k_cap, 0).astype(np.int32))
        importance_state = state.record_union(importance_state, layer.index, rows, len(chosen))
        selection = SharedIndices(jnp.arange(layer.k_cap, dtype=jnp.int32), len(chosen))
        weights = np.zeros(layer.m, np.float32)
        weights[chosen] = 1.0
        return Selected(importance_state, keys, values, selection, functools.partial(np.asarray, weights),
                        chosen[None])


systems.register(systems.System(
    "recent_window", identify="recent", prefetch="certain", cache_policy="lru",
    description="StreamingLLM's window: attention sinks and the most recent tokens (examples/recent_window.py)"))
